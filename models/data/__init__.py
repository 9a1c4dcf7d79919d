"""Data layer of fedsurv: loading, validation, partitioning and preprocessing (pandas/numpy only).

Entry point: :func:`build_federated_dataset`. Lower-level pieces: :func:`load_table`,
:func:`validate_survival_frame`, :func:`check_same_schema`,
:class:`Preprocessor` and :func:`partition_indices`.
"""

from models.data.datasets import DATASETS, RawTable, load_table
from models.data.federated import FederatedDataset, SiteData, SurvivalArrays, build_federated_dataset
from models.data.partition import natural_partition, partition_indices, stratified_split
from models.data.preprocess import FeatureStatistics, Preprocessor
from models.data.validate import (
    DataValidationError,
    check_same_schema,
    validate_survival_frame,
)

__all__ = [
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
    "load_table",
    "natural_partition",
    "partition_indices",
    "stratified_split",
    "validate_survival_frame",
]
