//! A config file, from TOML to a checked config (`RateLimitConfig::from_toml_str`). Properties:
//! nothing panics; a config that loads has a built policy for each route, found by its name, and
//! every error names what is wrong.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_redis_ratelimit::config::RateLimitConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match RateLimitConfig::from_toml_str(text) {
        Ok(config) => {
            for route in config.routes() {
                let policy = route.policy();
                let named = config
                    .policy(policy.name())
                    .expect("each route's policy by its name");
                assert_eq!(named.name(), policy.name());
                assert!(!route.paths().is_empty());
            }
        }
        Err(error) => assert!(!error.to_string().is_empty()),
    }
});
