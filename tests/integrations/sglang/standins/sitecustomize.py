"""Applies kvoffload's SGLang test stand-ins at interpreter start-up, in the processes
``tests/integrations/sglang/engine.py`` starts an engine for.

SGLang's ``Engine`` runs its scheduler (one per TP rank) and detokenizer in child
processes started with ``multiprocessing``'s ``spawn``: fresh interpreters that import
SGLang again, so patches made in the test process do not reach them. Python imports a
module named ``sitecustomize`` from its path at start-up; ``engine.py`` puts this folder
(and the one above it) on ``PYTHONPATH`` and sets ``KVOFFLOAD_SGLANG_STANDINS=1`` while
an engine starts and runs, so every child installs ``engine_standins``' import hook
before it imports anything of SGLang's. Without that variable this file does nothing.
"""

import os

if os.environ.get("KVOFFLOAD_SGLANG_STANDINS") == "1":
    import engine_standins

    engine_standins.install()
