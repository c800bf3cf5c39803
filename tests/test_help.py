"""``--help`` is the full flag reference: every flag is listed, with its default."""

import argparse

import generate_flax


def test_every_flag_is_in_help_with_its_default():
    parser = generate_flax.build_parser()
    text = parser.format_help()
    formatter = generate_flax._HelpFormatter(prog="generate_flax.py")
    missing, no_default = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        missing += [flag for flag in action.option_strings if flag not in text]
        if action.default is argparse.SUPPRESS:  # --no_scan_layers: the negation of a shown flag
            continue
        shown = formatter._get_help_string(action)
        # A None default is the family's value or chosen for the run: the help says which.
        if "%(default)" not in shown and "default" not in shown.lower():
            no_default.append(action.option_strings[0])
    assert not missing, f"flags missing from --help: {missing}"
    assert not no_default, f"flags whose --help gives no default: {no_default}"


def test_help_shows_defaults():
    text = " ".join(generate_flax.build_parser().format_help().split())
    assert "--seed SEED seed of the CPU torch.Generator that draws the initial latents " \
           "(default: 42)" in text
    assert "(default: bfloat16)" in text
