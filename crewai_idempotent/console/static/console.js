// Live updates for the crewai-idempotent console. No inline script anywhere: the page's
// Content-Security-Policy allows only this file. The server says when the ledger moved
// (server-sent events on /events); this script fetches the page again and swaps each
// region marked data-live whose content changed. A region holding a form someone is
// filling in is left alone, with a note, so a decision is never reset under a hand.
"use strict";

(function () {
  const eventsUrl = document.body.dataset.events;
  if (!eventsUrl || !window.EventSource || !window.fetch || !window.DOMParser) {
    return;
  }
  const status = document.getElementById("live-status");
  let refreshing = false;
  let again = false;

  function say(text) {
    if (!status) return;
    status.textContent = text;
    status.hidden = !text;
  }

  function busy(region) {
    const active = document.activeElement;
    if (active && region.contains(active) && active.matches("input, textarea, select")) {
      return true;
    }
    for (const field of region.querySelectorAll("input, textarea")) {
      if (field.type === "hidden" || field.type === "radio" || field.type === "checkbox") {
        if ((field.type === "radio" || field.type === "checkbox")
            && field.checked !== field.defaultChecked) {
          return true;
        }
        continue;
      }
      if (field.value !== field.defaultValue) return true;
    }
    for (const select of region.querySelectorAll("select")) {
      for (const option of select.options) {
        if (option.selected !== option.defaultSelected) return true;
      }
    }
    return false;
  }

  async function refresh() {
    if (refreshing) {
      again = true;
      return;
    }
    refreshing = true;
    try {
      const response = await fetch(window.location.href, {
        credentials: "same-origin",
        headers: { "X-Console-Live": "1" },
        cache: "no-store",
      });
      if (response.status === 401 || response.redirected) {
        say("Your session ended: reload the page to log in again.");
        source.close();
        return;
      }
      if (!response.ok) return;
      const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
      let held = false;
      for (const region of document.querySelectorAll("[data-live]")) {
        const name = region.dataset.live;
        const next = fresh.querySelector('[data-live="' + CSS.escape(name) + '"]');
        if (!next || next.innerHTML === region.innerHTML) continue;
        if (busy(region)) {
          held = true;
          continue;
        }
        region.replaceWith(document.importNode(next, true));
      }
      say(held ? "Something changed while you were filling in a form: reload to see it." : "");
    } catch (error) {
      say("Live updates paused: the console did not answer.");
    } finally {
      refreshing = false;
      if (again) {
        again = false;
        refresh();
      }
    }
  }

  const source = new EventSource(eventsUrl);
  source.addEventListener("changed", refresh);
  source.addEventListener("open", function () { say(""); });
  source.addEventListener("error", function () {
    if (source.readyState === EventSource.CLOSED) {
      say("Live updates stopped: reload the page.");
    }
  });
})();
