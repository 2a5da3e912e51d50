"""skyrl-megatron: a Megatron-Core training backend for SkyRL.

`activate()` makes the host trainer use our workers for ``trainer.strategy=megatron``; the
`skyrl-megatron` command calls it for you.
"""

__version__ = "0.1.0"


def activate() -> None:
    """Route the host's ``trainer.strategy=megatron`` to skyrl-megatron's workers (idempotent)."""
    from skyrl_megatron.activation import activate as _activate

    _activate()


__all__ = ["activate", "__version__"]
