"""Tools around a real engine that are not part of the vLLM seam: a tiny model built
offline (``tiny_model``), in-process vLLM engines for the demo, benchmarks and tests
(``offline``), and the chat demo that ``kvoffload demo`` runs (``chat_demo``)."""
