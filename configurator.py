"""Command-line configuration for train.py and sample.py, nanoGPT style.

    python train.py config/train_owt_pope.py --batch_size=32 --compile=False

Arguments are applied left to right over the script's defaults: a path ending in .py is a config
file (plain assignments, executed as Python); --key=value overrides one key, its value read as a
Python literal (a bare word is taken as a string). An unknown key, or a value whose type does not
match the default's, raises cli.UserError with the valid keys as its details (exit code 2 under
cli.exit_on_user_error).
"""

import ast
import os
import types

from cli import UserError, note_renamed


def _typecheck(key, value, default):
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, type(default)):
        return value
    raise TypeError(f"{key} must be {type(default).__name__} like its default {default!r}, got {value!r}")


def _error(msg, defaults):
    keys = "\n".join(f"  {k} = {v!r}" for k, v in defaults.items())
    return UserError(msg, details=f"valid keys (with defaults):\n{keys}")


def configure(defaults, argv, renamed=None):
    """Return a new dict: `defaults` updated by the config files and --key=value items of argv.

    renamed: {old key: new key}; a setting under an old key sets the new one, after a one-line note.

    Raises UserError (details: the valid keys) on an unknown key, a value of the wrong type, a
    missing config file or a malformed argument.
    """
    cfg = dict(defaults)
    for arg in argv:
        if arg in ("-h", "--help"):
            raise _error("usage: [config.py] [--key=value ...]", defaults)
        if not arg.startswith("--"):
            if not arg.endswith(".py") or not os.path.isfile(arg):
                raise _error(f"config file {arg!r} not found (expected a path like config/train_owt_pope.py)", defaults)
            ns = dict(cfg)
            with open(arg) as f:
                exec(compile(f.read(), arg, "exec"), ns)
            items = [
                (k, v)
                for k, v in ns.items()
                if not k.startswith("_") and not isinstance(v, types.ModuleType) and (k not in cfg or v is not cfg[k])
            ]
        else:
            key, eq, raw = arg[2:].partition("=")
            if not eq:
                raise _error(f"argument {arg!r} must look like --key=value", defaults)
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw
            if isinstance(defaults.get(key), str) and not isinstance(value, str):
                value = raw  # a text setting keeps the text as typed, e.g. sample.py --start="[1, 2, 3]"
            items = [(key, value)]
        for key, value in items:
            if key in (renamed or {}) and key not in defaults:
                note_renamed(f"config key {key!r}", repr(renamed[key]))
                key = renamed[key]
            if key not in defaults:
                raise _error(f"unknown config key {key!r} (from {arg})", defaults)
            try:
                cfg[key] = _typecheck(key, value, defaults[key])
            except TypeError as e:
                raise _error(f"{e} (from {arg})", defaults) from None
    return cfg
