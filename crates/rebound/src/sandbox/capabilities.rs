//! Capabilities by name and number, and those rebound itself may pass on to a driver.
//!
//! Owns: the names (`CAP_CHOWN`, `chown`) and reading this process's permitted set. Must not:
//! decide which capabilities a driver keeps (`super::build` does).

use rebound_sys::sandbox::CAPABILITY_NAMES;

/// The capabilities this process may pass on (its permitted set), from `/proc/self/status`.
pub fn own_capabilities() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let hex = status.lines().find_map(|l| l.strip_prefix("CapPrm:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .unwrap_or(0)
}

/// The names of the capabilities in `bits` (bit n: capability n), in number order.
pub fn capability_names(bits: u64) -> Vec<&'static str> {
    CAPABILITY_NAMES
        .iter()
        .enumerate()
        .filter(|&(n, _)| bits & (1 << n) != 0)
        .map(|(_, name)| *name)
        .collect()
}

/// The number of capability `name` (`"CAP_CHOWN"`, or `"chown"`).
pub fn capability(name: &str) -> Option<u32> {
    let upper = name.to_ascii_uppercase();
    let full = if upper.starts_with("CAP_") {
        upper
    } else {
        format!("CAP_{upper}")
    };
    CAPABILITY_NAMES
        .iter()
        .position(|n| *n == full)
        .map(|i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_names_of_a_set_come_in_number_order() {
        assert_eq!(
            capability_names(1 << 24 | 1),
            ["CAP_CHOWN", "CAP_SYS_RESOURCE"]
        );
        assert!(capability_names(0).is_empty());
    }

    #[test]
    fn capability_names_are_found_with_or_without_prefix() {
        assert_eq!(capability("CAP_SYS_ADMIN"), Some(21));
        assert_eq!(capability("chown"), Some(0));
        assert_eq!(capability("CAP_FLY"), None);
    }
}
