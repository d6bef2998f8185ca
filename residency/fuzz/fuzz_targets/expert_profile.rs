#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_residency::profile::Profile;

fuzz_target!(|data: &[u8]| {
    if let Ok(profile) = Profile::parse(data) {
        let again = Profile::parse(profile.to_json().as_bytes()).expect("to_json output parses");
        assert_eq!(again, profile);
    }
});
