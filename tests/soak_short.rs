//! The soak binary in a short form: four threads, 400 steps, faults on 0.5 % of driver calls. It
//! must exit cleanly, having met faults, and leak nothing.

use std::process::Command;

#[test]
fn a_short_soak_under_faults_leaks_nothing() {
    let output = Command::new(env!("CARGO_BIN_EXE_soak"))
        .args(["--threads", "4", "--steps", "400", "--faults", "seed=5,rate=0.005"])
        .output()
        .expect("running the soak binary");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "soak failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("leaked: 0 bytes"), "{stdout}");
    let injected: u64 = stdout
        .split(" injected")
        .next()
        .and_then(|head| head.rsplit('(').next())
        .and_then(|n| n.trim().parse().ok())
        .expect("the number of faults injected");
    assert!(injected > 0, "faults were injected: {stdout}");
    assert!(stdout.contains("error cu"), "the runtime met driver errors and went on: {stdout}");
}
