"""Greedy outputs of the engine without kvoffload, computed once per test session.

Several engine modules compare kvoffload's outputs with those of ``make_llm(model)`` (the
tiny Llama, no kvoffload, default engine settings), and each started an engine of its own
for them. Instead, a module names its prompts when it is imported (``want(*texts)``:
collection imports every module before the first test runs), and the session fixture
``reference`` (``conftest.py``) answers ``reference[text]``, the output token ids of
``greedy(llm, text)`` (8 tokens): on first use it starts one such engine, computes every
prompt named so far (one request at a time, as the modules did), and closes the engine.
A prompt named later costs one more engine. Ask only while no other engine is open in
the process (one in-process engine at a time).
"""

from __future__ import annotations

_WANTED: dict[str, None] = {}  # insertion-ordered set of the prompts named


def want(*texts: str) -> tuple[str, ...]:
    """Name prompts whose reference outputs a module will ask for; returns them."""
    _WANTED.update(dict.fromkeys(texts))
    return texts


class Reference:
    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._outputs: dict[str, list[int]] = {}

    def __getitem__(self, text: str) -> list[int]:
        if text not in self._outputs:
            self._compute([text, *(t for t in _WANTED if t not in self._outputs and t != text)])
        return self._outputs[text]

    def _compute(self, texts: list[str]) -> None:
        from vllm.distributed.parallel_state import model_parallel_is_initialized

        from kvoffload.demo.offline import close_llm, greedy, make_llm

        # a second in-process engine would share the first one's distributed state
        assert not model_parallel_is_initialized(), "an engine is open: ask for references before starting it"
        llm = make_llm(self.model_path)
        try:
            for text in texts:
                self._outputs[text] = greedy(llm, text)[0]
        finally:
            close_llm(llm)
