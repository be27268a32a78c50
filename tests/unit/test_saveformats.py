"""``%dist save --format`` / ``--max-shard-size`` values (distnb/core/saveformats.py), and the magic's parser."""

import pytest

from distnb.train import hfsaving
from distnb.core.errors import PlanError
from distnb.core.saveformats import check_format, shard_bytes


@pytest.mark.parametrize("given,want", [(1000, 1000), ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30),
                                        ("1.5 gb", 1_500_000_000), ("300", 300), ("64KiB", 65536)])
def test_sizes_read_as_transformers_reads_them(given, want):
    assert shard_bytes(given) == want


@pytest.mark.parametrize("bad", [0, -5, "big", "5XB", "", None, True, 1.5, "-1GB"])
def test_a_bad_size_is_refused_with_examples(bad):
    with pytest.raises(PlanError, match="positive size such as 5GB, 500MB"):
        shard_bytes(bad)


def test_formats():
    assert check_format("dcp", False) == "dcp" and check_format("safetensors", False) == "safetensors"
    assert check_format("dcp", True) == "safetensors"  # adapters are peft's safetensors files whatever the format
    with pytest.raises(PlanError, match=r"--format 'pt' is not one of dcp, safetensors: dcp \(a checkpoint"):
        check_format("pt", False)


def test_the_magic_line_parses_into_the_session_keywords():
    from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

    @magic_arguments(name="dist save")
    @hfsaving.save_arguments(argument)
    def save(line):
        """Save."""

    args = parse_argstring(save, "out/x --format safetensors --max-shard-size 5GB --model net")
    assert hfsaving.save_keywords(args) == dict(directory="out/x", model="net", format="safetensors", adapters=False,
                                                max_shard_size="5GB")
    args = parse_argstring(save, "--adapters out/lora")
    assert hfsaving.save_keywords(args)["adapters"] is True and args.format == "dcp"
