//! A buffer of a step (or micro-step) borrows it: using the buffer after the step ended, or
//! ending a step while a micro-step or buffer of it is alive, does not compile.

#[test]
fn step_boundaries_are_checked_by_the_borrow_checker() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/compile_fail/*.rs");
}
