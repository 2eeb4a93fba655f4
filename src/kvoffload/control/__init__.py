"""Session controls from outside the engine's requests: an HTTP endpoint (``server``)
whose commands (``sessions``) run on the scheduler thread through a queue (``queue``)."""
