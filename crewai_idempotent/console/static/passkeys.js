// Passkeys for the crewai-idempotent console: registering one (the Passkeys page) and
// signing an approval or a denial with one (a request's page). No inline script: the
// Content-Security-Policy allows only the console's own files. The console makes every
// option and checks every answer; this file carries them between it and
// navigator.credentials, then sends the form as a normal post.
"use strict";

(function () {
  if (window.crewaiPasskeys) return;  // loaded once, whatever the page includes
  window.crewaiPasskeys = true;

  function bytes(text) {
    const plain = text.replace(/-/g, "+").replace(/_/g, "/");
    const padded = plain + "===".slice((plain.length + 3) % 4);
    return Uint8Array.from(atob(padded), function (c) { return c.charCodeAt(0); });
  }

  function text(buffer) {
    let binary = "";
    for (const byte of new Uint8Array(buffer)) binary += String.fromCharCode(byte);
    return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function descriptors(list) {
    return (list || []).map(function (c) { return Object.assign({}, c, { id: bytes(c.id) }); });
  }

  function creationOptions(json) {
    return Object.assign({}, json, {
      challenge: bytes(json.challenge),
      user: Object.assign({}, json.user, { id: bytes(json.user.id) }),
      excludeCredentials: descriptors(json.excludeCredentials),
    });
  }

  function requestOptions(json) {
    return Object.assign({}, json, {
      challenge: bytes(json.challenge),
      allowCredentials: descriptors(json.allowCredentials),
    });
  }

  // The credential as JSON (WebAuthn Level 3's toJSON where the browser has it).
  function asJSON(credential) {
    if (typeof credential.toJSON === "function") return credential.toJSON();
    const r = credential.response;
    const response = { clientDataJSON: text(r.clientDataJSON) };
    if (r.attestationObject) {
      response.attestationObject = text(r.attestationObject);
      if (r.getTransports) response.transports = r.getTransports();
    } else {
      response.authenticatorData = text(r.authenticatorData);
      response.signature = text(r.signature);
      if (r.userHandle) response.userHandle = text(r.userHandle);
    }
    return {
      id: credential.id,
      rawId: text(credential.rawId),
      type: credential.type,
      response: response,
      authenticatorAttachment: credential.authenticatorAttachment || null,
      clientExtensionResults: credential.getClientExtensionResults(),
    };
  }

  function say(form, message, bad) {
    const status = form.parentElement.closest("section").querySelector(".passkey-status");
    if (!status) return;
    status.textContent = message;
    status.hidden = !message;
    status.classList.toggle("bad", Boolean(bad));
  }

  // Post the form's fields (but those this file fills) to `url`; its JSON answer, or
  // an Error saying what the console answered instead.
  async function ask(url, form) {
    const body = new URLSearchParams();
    for (const [name, value] of new FormData(form)) {
      if (!["decision", "assertion", "credential"].includes(name)) body.append(name, value);
    }
    const response = await fetch(url, {
      method: "POST", body: body, credentials: "same-origin", cache: "no-store",
      headers: { Accept: "application/json" },
    });
    const type = response.headers.get("content-type") || "";
    if (type.startsWith("application/json")) {
      const answer = await response.json();
      if (!response.ok) throw new Error(answer.error || response.statusText);
      return answer;
    }
    const page = new DOMParser().parseFromString(await response.text(), "text/html");
    const said = page.querySelector("main .message, main .error, main");
    throw new Error(said ? said.textContent.trim() : response.status + " " + response.statusText);
  }

  // Post the form with `filled` (its fields this file fills) as the page would. A copy
  // is sent: a live update may have replaced the form while the passkey was asked.
  function send(form, filled) {
    const out = document.createElement("form");
    out.method = "post";
    out.action = form.action;
    out.hidden = true;
    for (const [name, value] of new FormData(form)) {
      const field = document.createElement("input");
      field.type = "hidden";
      field.name = name;
      field.value = name in filled ? filled[name] : value;
      out.appendChild(field);
    }
    document.body.appendChild(out);
    out.submit();
  }

  function usable() {
    if (!window.isSecureContext) {
      throw new Error("Passkeys work only over https (or on localhost): open the console there.");
    }
    if (!window.PublicKeyCredential || !navigator.credentials) {
      throw new Error("This browser cannot use passkeys.");
    }
  }

  async function sign(form) {
    usable();
    say(form, "Preparing the decision…");
    const answer = await ask(form.dataset.challenge, form);
    say(form, answer.summary + " Touch or unlock your passkey.");
    const credential = await navigator.credentials.get({
      publicKey: requestOptions(answer.publicKey),
    });
    say(form, "Signed: sending it to the console…");
    send(form, {
      decision: JSON.stringify(answer.decision),
      assertion: JSON.stringify(asJSON(credential)),
    });
  }

  async function register(form) {
    usable();
    say(form, "Asking your device for a new passkey…");
    const answer = await ask(form.dataset.register, form);
    const credential = await navigator.credentials.create({
      publicKey: creationOptions(answer.publicKey),
    });
    say(form, "Made: sending it to the console…");
    send(form, { credential: JSON.stringify(asJSON(credential)) });
  }

  function explain(error) {
    if (error && error.name === "NotAllowedError") {
      return "The passkey did not answer (cancelled, timed out, or none of yours is on this "
        + "device). Nothing was decided.";
    }
    if (error && error.name === "InvalidStateError") {
      return "This device already holds one of your passkeys for this console.";
    }
    return (error && error.message) || String(error);
  }

  document.addEventListener("submit", function (event) {
    const form = event.target;
    if (!(form instanceof HTMLFormElement)) return;
    const job = form.dataset.challenge ? sign : form.dataset.register ? register : null;
    if (!job) return;
    event.preventDefault();
    if (form.dataset.busy) return;
    form.dataset.busy = "1";
    job(form).catch(function (error) {
      delete form.dataset.busy;
      say(form, explain(error), true);
    });
  });

  document.addEventListener("click", function (event) {
    const button = event.target instanceof Element && event.target.closest("button[data-copy]");
    if (!button) return;
    const source = document.getElementById(button.dataset.copy);
    if (!source || !navigator.clipboard) return;
    navigator.clipboard.writeText(source.textContent).then(function () {
      button.textContent = "Copied";
    });
  });
})();
