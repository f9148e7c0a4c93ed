//! Configuration files on arbitrary text: reading TOML, JSON and gRPC service configs
//! never panics, and whatever the checked reader accepts, `Config` turns into parts
//! without an error (every value a builder would refuse was refused when read).
#![no_main]

use libfuzzer_sys::fuzz_target;
use stormguard::Config;
use stormguard_core::config::Settings;

fuzz_target!(|input: (u8, &str)| {
    let (form, text) = input;
    let (settings, config) = match form % 3 {
        0 => (Settings::from_toml(text), Config::from_toml(text)),
        1 => (Settings::from_json(text), Config::from_json(text)),
        _ => (
            Settings::from_grpc_service_config(text),
            Config::from_grpc_service_config(text),
        ),
    };
    match (settings, config) {
        (Ok(settings), Ok(config)) => {
            for (name, _) in settings.dependencies() {
                assert!(config.dependency(name).is_ok(), "{name}");
            }
        }
        (Err(a), Err(b)) => assert_eq!(a, b),
        (Ok(_), Err(err)) => panic!("read, then refused by a builder: {err}"),
        (Err(err), Ok(_)) => panic!("refused when read, then built: {err}"),
    }
});
