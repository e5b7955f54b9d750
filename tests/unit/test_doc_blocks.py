"""Every shell block of README.md and the guides has a place in CI (tests/fixtures/doc_blocks.py): a block
added without one, or a place whose block is gone, fails here; and the runner's own arithmetic holds."""

from __future__ import annotations

from tests.fixtures.doc_blocks import (
    WHERE,
    Block,
    Place,
    all_blocks,
    expected_exit,
    parse_blocks,
    replace_paths,
    run_block,
)

STAGES = {"integration", "container", "lab", "remote", "ci", "maintainer", "interactive"}


def test_every_block_has_a_place_and_every_place_a_block():
    blocks = all_blocks()
    keys = {block.key for block in blocks}
    assert len(blocks) >= 25
    missing = [f"{block.page}:{block.line}: {block.key[1]}" for block in blocks if block.key not in WHERE]
    assert not missing, (
        "shell blocks no stage runs (add them to tests/fixtures/doc_blocks.WHERE): " + "; ".join(missing)
    )
    stale = [key for key in WHERE if key not in keys]
    assert not stale, f"places for blocks no page has: {stale}"
    assert {place.stage for place in WHERE.values()} <= STAGES


def test_a_block_indented_in_a_list_item_is_found_without_its_indentation():
    text = """\
1. **Start** it:

   ```sh
   echo one \\
     two   # said

   echo three
   ```

   ```yaml
   key: value
   ```
2. Then:
```sh
echo four
    ```
echo five
```
"""
    blocks = parse_blocks("x.md", text)
    assert [(block.line, block.commands) for block in blocks] == [
        (3, ["echo one    two   # said", "echo three"]),
        # A fence indented otherwise than the opening one does not close the block.
        (14, ["echo four", "```", "echo five"]),
    ]
    assert blocks[0].key == ("x.md", "echo one two")


def test_commands_join_continuations_and_drop_comments():
    block = Block("x.md", 1, "# a comment\n\necho one \\\n  two   # said\n'#' quoted\n")
    assert block.commands == ["echo one    two   # said", "'#' quoted"]
    assert block.key == ("x.md", "echo one two")


def test_the_runner_checks_each_exit_code(tmp_path, monkeypatch):
    block = Block("x.md", 1, "true\nfalse\n(exit 3)")
    monkeypatch.setitem(WHERE, block.key, Place("integration", "here", {"exit 3": 3}))
    wrong = run_block(block, tmp_path)
    assert wrong[0] == "'false': exit 1, documented 0" and len(wrong) == 2
    assert expected_exit(WHERE[block.key], "exit 3") == 3
    monkeypatch.setitem(WHERE, block.key, Place("integration", "here", {"exit 3": 3, "false": 1}))
    assert run_block(block, tmp_path) == []


def test_user_paths_are_replaced_once_longest_first():
    paths = {"/data/set": "/tmp/x/data/set", "/data/set/labels": "/tmp/x/data/set/labels"}
    command = "evaluate --labels /data/set/labels --data /data/set"
    assert replace_paths(command, paths) == "evaluate --labels /tmp/x/data/set/labels --data /tmp/x/data/set"
