"""Federated datasets: sources, partitioners, per-client splits, client-major tensors with a disk cache."""

from fedpilot.data.config import DatasetSpec, PartitionSpec, SourceSpec, SplitSpec
from fedpilot.data.federated import FederatedData, build_federated_data, fingerprint
from fedpilot.data.summary import describe, format_summary, label_skew

__all__ = ["DatasetSpec", "FederatedData", "PartitionSpec", "SourceSpec", "SplitSpec", "build_federated_data",
           "describe", "fingerprint", "format_summary", "label_skew"]
