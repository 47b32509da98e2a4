"""The config's errors and warnings: what a user sees when a config is wrong or does nothing."""
from __future__ import annotations

import functools


_RELEASE = "dsrun 0.1"


class ConfigError(ValueError):
    """A ds_config that cannot be used, with every problem found in it.

    `ConfigError("optimizer.params.lr: must be > 0, got -1")` is one problem
    and reads as just that line; with several problems or a `source`, the
    message is a header naming the source, then one problem per line.

    Attributes:
        problems: one line per problem, each starting with the dotted key
            path it is about, saying what was wrong and how to fix it.
        source: where the config came from (a file path, "dict"), or None.
    """

    def __init__(self, *problems: str, source: str | None = None):
        self.problems = list(problems)
        self.source = source
        if source is None and len(self.problems) == 1:
            super().__init__(self.problems[0])
            return
        count = len(self.problems)
        where = f" ({source})" if source else ""
        head = f"invalid dsrun config{where}: {count} problem{'s' if count != 1 else ''}"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))

    def __reduce__(self):  # keep it picklable, e.g. to report a rank's failure to another process
        return functools.partial(type(self), source=self.source), tuple(self.problems)


class _Problem(ValueError):
    """Raised by validators below with a message already written for the user.

    `key`, when given, is the field of the validated model the message is
    about; the translation of pydantic errors appends it to the key path.
    """

    def __init__(self, text: str, key: str | None = None):
        super().__init__(text)
        self.text = text
        self.key = key


class ConfigWarning(UserWarning):
    """A config setting that is valid but has no effect in this release."""
