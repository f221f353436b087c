"""TrainingArguments flags as a list of strings (``--learning_rate 2e-5 --bf16 ...``): what
``zerotune finetune`` passes through to ``HfArgumentParser``, records for ``--resume`` and
reads from a job file's ``training`` section."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["flag_groups", "flag_name", "flag_value"]


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--name`` (or ``--name-with-dashes``) in ``argv``, in either ``--flag
    value`` or ``--flag=value`` form; None when the flag is not there."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in spellings:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def flag_groups(argv: Sequence[str]) -> list[list[str]]:
    """``--flag value ...`` groups of a flag list (values do not start with ``--``)."""
    groups: list[list[str]] = []
    for arg in argv:
        if arg.startswith("--"):
            groups.append([arg])
        elif groups:
            groups[-1].append(arg)
    return groups


def flag_name(flag: str) -> str:
    """The field name a flag sets: ``--learning-rate=1`` -> ``learning_rate``."""
    return flag[2:].split("=")[0].replace("-", "_")
