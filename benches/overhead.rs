//! Placeholder: the criterion benchmark is not written yet.

fn main() {}
