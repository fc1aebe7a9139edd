"""The version of nvrx, for the programs' ``--version`` (kept where every layer may import it)."""

__version__ = "0.1.0"
