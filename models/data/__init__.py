"""Data layer of fedsurv: loading, validation, partitioning and preprocessing (pandas/numpy only).

Entry point: :func:`build_federated_dataset`. Lower-level pieces: :func:`load_table`,
:func:`validate_survival_frame`, :func:`check_same_schema`,
:class:`Preprocessor` and :func:`partition_indices`. :func:`data_file` finds a named data set's file
(``data.dir``, else ``$FEDSURV_DATA_DIR``, else the copy bundled in ``models/data/bundled/``).
"""

from models.data.datasets import DATASETS, ColumnRoles, RawTable, load_table
from models.data.federated import FederatedDataset, SiteData, SurvivalArrays, build_federated_dataset
from models.data.files import BUNDLED_DIR, data_file, resolve_data_dir
from models.data.partition import natural_partition, partition_indices, stratified_split
from models.data.preprocess import FeatureStatistics, Preprocessor
from models.data.validate import (
    DataValidationError,
    check_same_schema,
    validate_survival_frame,
)

__all__ = [
    "BUNDLED_DIR",
    "ColumnRoles",
    "DATASETS",
    "DataValidationError",
    "FeatureStatistics",
    "FederatedDataset",
    "Preprocessor",
    "RawTable",
    "SiteData",
    "SurvivalArrays",
    "build_federated_dataset",
    "check_same_schema",
    "data_file",
    "load_table",
    "natural_partition",
    "partition_indices",
    "resolve_data_dir",
    "stratified_split",
    "validate_survival_frame",
]
