"""Offloading tiers built from configuration (``factory``); the CPU tier's bookkeeping
is ``kvoffload.cpu``, its worker ``kvoffload.transfer``."""
