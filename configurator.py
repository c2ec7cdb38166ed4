"""Command-line configuration for train.py and sample.py, nanoGPT style.

    python train.py config/train_owt_pope.py --batch_size=32 --compile=False

Arguments are applied left to right over the script's defaults: a path ending in .py is a config
file (plain assignments, executed as Python); --key=value overrides one key, its value read as a
Python literal (a bare word is taken as a string). An unknown key, or a value whose type does not
match the default's, prints the error with the valid keys and exits with code 2.
"""

import ast
import os
import sys
import types


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


def _fail(msg, defaults):
    keys = "\n".join(f"  {k} = {v!r}" for k, v in defaults.items())
    print(f"error: {msg}\nvalid keys (with defaults):\n{keys}", file=sys.stderr)
    sys.exit(2)


def configure(defaults, argv):
    """Return a new dict: `defaults` updated by the config files and --key=value items of argv.

    Exits with code 2 (after printing the error and the valid keys) on an unknown key, a value of
    the wrong type, a missing config file or a malformed argument.
    """
    cfg = dict(defaults)
    for arg in argv:
        if arg in ("-h", "--help"):
            _fail("usage: [config.py] [--key=value ...]", defaults)
        if not arg.startswith("--"):
            if not arg.endswith(".py") or not os.path.isfile(arg):
                _fail(f"config file {arg!r} not found (expected a path like config/train_owt_pope.py)", defaults)
            ns = dict(cfg)
            with open(arg) as f:
                exec(compile(f.read(), arg, "exec"), ns)
            items = [(k, v) for k, v in ns.items() if not k.startswith("_") and not isinstance(v, types.ModuleType)
                     and (k not in cfg or v is not cfg[k])]
        else:
            key, eq, raw = arg[2:].partition("=")
            if not eq:
                _fail(f"argument {arg!r} must look like --key=value", defaults)
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw
            if isinstance(defaults.get(key), str) and not isinstance(value, str):
                value = raw  # a text setting keeps the text as typed, e.g. sample.py --start="[1, 2, 3]"
            items = [(key, value)]
        for key, value in items:
            if key not in defaults:
                _fail(f"unknown config key {key!r} (from {arg})", defaults)
            try:
                cfg[key] = _typecheck(key, value, defaults[key])
            except TypeError as e:
                _fail(f"{e} (from {arg})", defaults)
    return cfg
