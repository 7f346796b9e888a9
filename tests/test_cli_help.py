"""Every engine flag has help text that shows its default, from one source (EngineConfig's FIELD_HELP)."""

from __future__ import annotations

import argparse

from backend.types.config import FIELD_HELP, EngineConfig


def test_every_engine_flag_has_help_with_its_default():
    assert set(FIELD_HELP) == set(EngineConfig.field_names()) - {"model"}
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    for action in parser._actions:
        if action.dest in FIELD_HELP:
            assert action.help.startswith(FIELD_HELP[action.dest].split(" (default:")[0])
            assert "(default: " in action.help, action.dest
    help_text = parser.format_help()
    assert "--max-num-seqs MAX_NUM_SEQS\n" in help_text and "(default: 256)" in help_text
    assert "(default: on)" in help_text  # booleans read on/off
