"""Tooling around the library, not part of it: the theory and measurement commands (`analyze`,
`measure`), draft design and tree-shape search, and the benchmarks (`bench`)."""
