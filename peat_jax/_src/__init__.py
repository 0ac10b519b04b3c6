"""The implementation of peat_jax. Nothing here is public: the API is what `peat_jax` and its
namespaces (`peat_jax.kernels`, `peat_jax.faults`, `peat_jax.testing`, `peat_jax.report`,
`peat_jax.models`) re-export. docs/design.md says which module holds what."""
