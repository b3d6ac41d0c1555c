"""Jinja module templates and the hand-written kernel headers under include/attnforge/."""
