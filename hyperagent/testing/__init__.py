"""Fakes for hardware that is not here, replaying real captures."""
