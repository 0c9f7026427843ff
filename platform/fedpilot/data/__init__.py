"""Federated datasets: sources, partitioners, per-client splits, client-major tensors with a disk cache.

Modules: config (the typed specs, pydantic only), sources, partition, text, shakespeare (building), federated
(`build_federated_data`, the cache, `FederatedData`), summary (`describe`). Import each name from its module; the
package itself imports nothing, and scikit-learn, Hugging Face `datasets` and `tokenizers` load only when a dataset is
built, not loaded from the cache."""
