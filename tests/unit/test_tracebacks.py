"""Remote tracebacks and messages as a RankError shows them (distnb.tracebacks), without a cluster."""

from distnb.tracebacks import clean_message, clean_traceback

STORE_ERROR = """failed to recv, got 0 bytes
Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:671 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f00 in libc10.so)
frame #1: <unknown function> + 0x5f1 (0x7f01 in libtorch_cpu.so)
<omitting python frames>
frame #2: clone + 0x44 (0x7f02 in libc.so.6)
"""


def test_the_cpp_stack_torch_appends_is_dropped_and_the_message_kept():
    assert clean_message(STORE_ERROR) == "failed to recv, got 0 bytes\n"
    assert clean_message("ValueError: no stack here") == "ValueError: no stack here"
    tb = "Traceback (most recent call last):\n  cell line 3\n\nDistBackendError: " + STORE_ERROR + "\n\nafter"
    cleaned = clean_traceback(tb)
    assert "frame #" not in cleaned and "Exception raised from" not in cleaned
    assert "DistBackendError: failed to recv, got 0 bytes" in cleaned and cleaned.endswith("after")
