"""Adapters that plug kvoffload into serving engines (one subpackage per engine)."""
