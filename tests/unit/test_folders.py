"""``distnb.core.folders.unwritable``: why a folder cannot be created and written, with nothing left behind."""

import os

from distnb.core.folders import unwritable


def test_a_writable_folder_and_one_to_create_are_fine_and_nothing_is_left(tmp_path):
    assert unwritable(str(tmp_path)) == ""
    assert unwritable(str(tmp_path / "a" / "b")) == ""
    assert os.listdir(tmp_path) == []  # no probe left, and the folder to create is not made


def test_a_file_in_the_way_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert unwritable(str(blocker)) == f"{blocker} is a file, not a folder"
    assert unwritable(str(blocker / "out" / "deeper")) == f"{blocker} is a file, not a folder"


def test_a_folder_that_cannot_be_written_is_named_with_what_was_to_be_created_in_it():
    assert unwritable("/proc/distnb-nope").startswith("/proc is not writable (to create /proc/distnb-nope in): ")
