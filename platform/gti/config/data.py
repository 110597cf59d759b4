"""The data section of the run config: `data:` (sources, columns, caps, the split) for ingest.

What it is for: `DataConfig` with its sources (`ItemsSource`, `InteractionsSource` and their
column maps), the dense subset, the split (`data.split`: leave-one-out or the global time split
with its ratios) and a MiniOneRec-style folder (`data.root`), kept out of `gti.config` (which
holds it in `RunConfig`) so that module stays small. `gti.config` re-exports the names, so
`from gti.config import ItemColumns` keeps working.

What it does not know: how files are read (`gti.data`), how sequences are split
(`gti.data.sequences`), Ray, torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gti.config.io import StrictModel as _Strict

# --------------------------------------------------------------------------- data
class ItemColumns(_Strict):
    """Maps the user's column names to ours."""

    id: str = Field("item_id", description="column of the item id")
    title: str | None = Field("title", description="column of the item title (None: the data has none)")
    description: str | None = Field(
        "description", description="column of the item description (None: the data has none)")
    category: str | None = Field("category", description="column of the item category (None: the data has none)")
    attributes: list[str] = Field(
        default_factory=lambda: ["brand"],
        description="extra attribute columns, used for pseudo-text when title and description are missing")


class InteractionColumns(_Strict):
    """Maps the user's interaction column names to ours."""

    user: str = Field("user_id", description="column of the user id")
    item: str = Field("item_id", description="column of the item id (the items' id values)")
    ts: str | None = Field("ts", description="column of the timestamp (None: file order is chronological order)")


_PATH_HELP = ("a local path, glob, directory or any URI pyarrow/fsspec understands, or bundled:<name> for a "
              "data set shipped inside the package")
_FORMAT_HELP = "reader of the files (auto: from the file extension; u.item/u.data are movielens)"
_STORAGE_HELP = "fsspec/pyarrow filesystem options (e.g. credentials for s3://); redacted in manifests"


class ItemsSource(_Strict):
    """Where the item catalog comes from."""

    path: str = Field("bundled:amazon-scientific", description=_PATH_HELP)
    format: Literal["auto", "parquet", "csv", "jsonl", "json", "amazon", "amazon2023", "movielens"] = Field(
        "auto", description=_FORMAT_HELP)
    columns: ItemColumns = Field(default_factory=ItemColumns, description="the item file's column names")
    storage_options: dict[str, str] = Field(default_factory=dict, description=_STORAGE_HELP)


class InteractionsSource(_Strict):
    """Where the user-item interactions come from."""

    path: str = Field("bundled:amazon-scientific", description=_PATH_HELP)
    format: Literal["auto", "parquet", "csv", "jsonl", "json", "amazon2023", "movielens"] = Field(
        "auto", description=_FORMAT_HELP)
    columns: InteractionColumns = Field(
        default_factory=InteractionColumns, description="the interaction file's column names")
    storage_options: dict[str, str] = Field(default_factory=dict, description=_STORAGE_HELP)


class DenseSubset(_Strict):
    """A dense subset of the data, built by ingest (`gti.data.dense`, as `gti data dense` does)."""

    top_items: int | None = Field(
        None, gt=0, description="keep only the N items with the most valid interactions (ties: catalog order) "
        "and the users active on them; the rest are quarantined as outside_dense (None: no subset, all data)")
    min_user_len: int = Field(
        5, ge=1, description="with top_items: keep users with at least this many interactions on those items "
        "(cut repeatedly until it holds; data.min_seq_len still applies after)")


class DataConfig(_Strict):
    """The ingest stage: sources, text limits, caps and sequence lengths."""

    items: ItemsSource = Field(default_factory=ItemsSource, description="the item catalog")
    interactions: InteractionsSource = Field(default_factory=InteractionsSource, description="the interactions")
    max_text_chars: int = Field(
        2000, gt=0, description="characters kept per text field; longer text is cut and the row flagged truncated")
    min_seq_len: int = Field(
        3, ge=1, description="users with fewer valid interactions are dropped (leave_one_out needs 3 at least: "
        "train, valid and test items; global_time 2: one item of history and one target)")
    max_history: int = Field(
        20, ge=1, description="most recent items in a user's history prompt (SFT windows and evaluation)")
    # The defaults are left out of the dump, so runs from before these keys keep their fingerprints.
    split: Literal["leave_one_out", "global_time"] = Field(
        "leave_one_out", exclude_if=lambda v: v == "leave_one_out", description="leave_one_out: each user's last item is the test target, the one before "
        "it the valid target; global_time: all interactions sorted by time (ties: file order) are cut by "
        "data.split_ratios into train, valid and test periods, and every valid/test interaction with an earlier "
        "one is a row (docs/data.md, Splits)")
    split_ratios: list[float] = Field(
        default_factory=lambda: [8.0, 1.0, 1.0], min_length=3, max_length=3,
        exclude_if=lambda v: list(v) == [8.0, 1.0, 1.0], description="global_time: the "
        "train:valid:test shares of all interactions, in time order (8:1:1, as MiniOneRec, D3 and BIGRec split)")
    root: str | None = Field(
        None, exclude_if=lambda v: v is None, description="a folder in MiniOneRec's layout (train/, valid/, "
        "test/ CSVs, and index/ with <name>.item.json): the items and interactions come from it (data.items and "
        "data.interactions are not read) and the split is theirs, so data.split must be global_time")
    dataset: str | None = Field(
        None, exclude_if=lambda v: v is None, description="with data.root: the name its files start with "
        "(e.g. Industrial_and_Scientific), needed when the folders hold more than one data set")
    max_items: int | None = Field(
        None, gt=0, description="use only the first N valid items (None: all); handy for quick runs")
    max_users: int | None = Field(
        None, gt=0, description="use only the first N users (in file order) with enough interactions (None: all)")
    dense: DenseSubset = Field(
        default_factory=DenseSubset, description="a dense subset (top items and their active users) built "
        "by ingest from these keys, for small training budgets; off unless dense.top_items is set")
    parallelism: int | None = Field(
        None, gt=0, description="Ray Data read/processing parallelism (None: Ray decides)")
    on_unreadable_file: Literal["error", "skip"] = Field(
        "error", description="a file that cannot be read (damaged page, truncated gzip, zero bytes, ragged CSV "
        "row): error stops the stage with one line naming it; skip leaves the whole file out and records it in "
        "the ingest manifest (facts.skipped_files)")

    @model_validator(mode="after")
    def _split_keys(self) -> "DataConfig":
        if any(r <= 0 for r in self.split_ratios):
            raise ValueError(f"data.split_ratios: every share must be > 0, got {self.split_ratios}")
        if self.root is not None and self.split != "global_time":
            raise ValueError("data.root reads train/valid/test files already split by time: set "
                             "data.split=global_time")
        return self
