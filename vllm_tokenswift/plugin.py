"""Placeholder; replaced by the real plugin."""


def register() -> None:
    return None
