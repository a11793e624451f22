//! Cross-crate scenarios live in tests/tests/*.rs.
