"""A scripted stand-in for a model: it asks for tool calls, then gives a final answer.

It works out where it is from the conversation crewai hands it, the way a real model
would: an attempt (a fresh `execute_task`) starts with no tool results after the last
system prompt;
within an attempt, the number of tool results seen says which batch of calls comes next.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from crewai.llms.base_llm import BaseLLM
from pydantic import BaseModel, Field

Call = tuple[str, dict[str, Any]]


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else str(message)
    return content if isinstance(content, str) else json.dumps(content, default=str)


class ScriptedLLM(BaseLLM):
    """`batches[i]` is the list of tool calls the model makes in turn i of an attempt.

    `native=True` answers with OpenAI-style tool calls (crewai's native function-calling
    path, where a batch of several calls runs in parallel); otherwise it writes ReAct
    text, one call per turn. `retry_batches` replaces `batches` from the second attempt
    on (a model that rewrites its arguments after a guardrail rejection). `fail_times`
    makes the model raise that many times once its calls are done, which is what
    triggers the agent's `max_retry_limit` retry.
    """

    llm_type: str = "scripted"
    native: bool = False
    batches: list[list[Call]] = Field(default_factory=list)
    retry_batches: list[list[Call]] | None = None
    fail_times: int = 0
    final_answer: str | None = None

    calls: int = 0
    attempts: int = 0
    failures: int = 0
    tool_schemas: list[Any] = Field(default_factory=list)
    prompts: list[str] = Field(default_factory=list)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        self._lock = threading.Lock()

    if not issubclass(BaseLLM, BaseModel):
        # crewai < 1.13: BaseLLM is a plain ABC, and the annotations above are not fields.
        def __init__(self, model: str, **options: Any) -> None:
            defaults: dict[str, Any] = {
                "native": False, "batches": [], "retry_batches": None, "fail_times": 0,
                "final_answer": None, "calls": 0, "attempts": 0, "failures": 0,
                "tool_schemas": [], "prompts": [],
            }  # fmt: skip
            own = {k: options.pop(k) for k in list(options) if k in defaults}
            super().__init__(model=model, **options)
            for name, default in defaults.items():
                value = own.get(name, default)
                setattr(self, name, list(value) if isinstance(value, list) else value)
            self._lock = threading.Lock()

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        # crewai's BaseLLM.acall raises NotImplementedError in every release.
        return self.call(*args, **kwargs)

    def supports_function_calling(self) -> bool:
        return self.native

    def supports_stop_words(self) -> bool:
        return False

    def get_context_window_size(self) -> int:
        return 100_000

    def get_input_tokens_count(
        self, messages: Any, tools: Any = None, response_model: Any = None
    ) -> int:
        return len(json.dumps(messages, default=str)) // 4 + 1

    def call(
        self,
        messages: Any,
        tools: Any = None,
        callbacks: Any = None,
        available_functions: Any = None,
        from_task: Any = None,
        from_agent: Any = None,
        response_model: Any = None,
    ) -> Any:
        msgs = messages if isinstance(messages, list) else [{"role": "user", "content": messages}]
        with self._lock:
            self.calls += 1
            if tools:
                self.tool_schemas.append(tools)
            self.prompts.extend(_text(m) for m in msgs if isinstance(m, dict))
            # An attempt starts at the last system prompt: crewai < 1.14.4 keeps the
            # earlier attempts' messages in the conversation of a retry.
            starts = [
                i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "system"
            ]
            results = self._tool_results(msgs[starts[-1] :] if starts else msgs)
            if self.native and not tools:  # asked for prose (a summary), not for tool calls
                return "; ".join(results) if results else "nothing to do"
            if not results:
                self.attempts += 1
            plan = self.batches
            if self.attempts > 1 and self.retry_batches is not None:
                plan = self.retry_batches
            done = len(results)
            seen = 0
            for batch in plan:
                if done < seen + len(batch):
                    return self._ask(batch if self.native else batch[done - seen : done - seen + 1])
                seen += len(batch)
            if self.failures < self.fail_times:
                self.failures += 1
                raise RuntimeError("scripted model failure after its tool calls")
            answer = self.final_answer or ("; ".join(results) if results else "nothing to do")
            if self.native:
                return answer
            return f"Thought: I now know the final answer\nFinal Answer: {answer}"

    def _tool_results(self, msgs: list[Any]) -> list[str]:
        found: list[str] = []
        for m in msgs:
            if not isinstance(m, dict):
                continue
            if self.native and m.get("role") == "tool":
                found.append(_text(m).strip())
            elif not self.native and m.get("role") == "assistant" and "Observation:" in _text(m):
                # The system prompt also says "Observation:"; only assistant turns count.
                # One action and its observation per message. crewai appends a reminder
                # of the format (which says "Observation:" too) to every few of them.
                observation = _text(m).split("Observation:", 1)[1]
                found.append(observation.strip().split("\n\n")[0].strip())
        return found

    def _ask(self, batch: list[Call]) -> Any:
        if self.native:
            return [
                {
                    "id": f"call_{self.calls}_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
                for i, (name, args) in enumerate(batch)
            ]
        name, args = batch[0]
        return f"Thought: I need to use {name}\nAction: {name}\nAction Input: {json.dumps(args)}"
