#!/usr/bin/env python3
"""Adds the rows of one dataset to a split of another, in the Hugging Face `save_to_disk`
layout (what `datasets.concatenate_datasets` then `save_to_disk` would give, without copying
the existing rows): the Arrow files of SOURCE (a split folder, or a dataset without splits) are
copied into TARGET_SPLIT under PREFIX + their name and appended to its state.json's
"_data_files". Both must have the same columns. Standard library only.

  python3 lab/add_split_files.py SOURCE TARGET_SPLIT PREFIX
"""
import json
import shutil
import sys
from pathlib import Path


def arrow_files(folder):
    state = folder / "state.json"
    if state.is_file():
        return [folder / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    return sorted(folder.glob("*.arrow"))


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__.split("\n\n")[1])
    source, target, prefix = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if not (source / "state.json").is_file() and (source / "dataset_dict.json").is_file():
        sys.exit(f"{source}: a dataset with splits; name one split folder")
    files = arrow_files(source)
    if not files:
        sys.exit(f"{source}: no Arrow files")
    state_path = target / "state.json"
    if not state_path.is_file():
        sys.exit(f"{state_path}: missing: {target} is not a split folder")
    state = json.loads(state_path.read_text())
    listed = {f["filename"] for f in state["_data_files"]}
    for f in files:
        name = prefix + f.name
        if name in listed:
            sys.exit(f"{target}: already lists {name}")
        shutil.copyfile(f, target / name)
        state["_data_files"].append({"filename": name})
    # a new fingerprint: the split's content changed
    state["_fingerprint"] = f"{state.get('_fingerprint', '')}+{prefix}"
    tmp = state_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(state_path)
    print(f"{target}: {len(files)} file(s) from {source} added, {len(state['_data_files'])} in all")


if __name__ == "__main__":
    main()
