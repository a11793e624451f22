//! Cross-crate scenarios live in `tests/tests/*.rs`, one file per theme, each test named
//! after the scenario it proves.
