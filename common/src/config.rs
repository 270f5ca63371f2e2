//! Config primitives shared by the roles' serde config structs: human durations, and loading a TOML
//! file with a clear error naming the file.

use std::{fmt, path::Path, time::Duration};

use serde::{de, Deserializer, Serializer};

/// Parses "10s", "500ms", "2m", "1h 30m".
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("invalid duration {s:?} ({e}): expected e.g. \"10s\" or \"500ms\""))
}

/// Parses a flag value that is either a human duration ("10s") or a bare number in `unit`
/// (Mooncake's flags take bare milliseconds or seconds).
pub fn parse_duration_in(s: &str, unit: Duration) -> Result<Duration, String> {
    match s.trim().parse::<u64>() {
        Ok(n) => {
            // Mooncake's flags are 64-bit: any count of the unit that a Duration holds.
            let too_large = || format!("duration {s:?} is too large");
            let nanos = unit
                .as_nanos()
                .checked_mul(u128::from(n))
                .ok_or_else(too_large)?;
            let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| too_large())?;
            Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
        }
        Err(_) => parse_duration(s),
    }
}

/// `#[serde(with = "mooncake_common::config::duration")]` for human-readable durations.
pub mod duration {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Duration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"10s\" or \"500ms\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
                parse_duration(v).map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {message}")]
    Parse { path: String, message: String },
}

/// Reads and parses a TOML config file; unknown keys are rejected by the target type.
pub fn load_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_toml(&text).map_err(|message| ConfigFileError::Parse {
        path: path.display().to_string(),
        message,
    })
}

pub fn parse_toml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    toml::from_str(text).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert!(parse_duration("ten").is_err());
        assert_eq!(
            parse_duration_in("5000", Duration::from_millis(1)).unwrap(),
            Duration::from_secs(5)
        );
        assert_eq!(
            parse_duration_in("2m", Duration::from_secs(1)).unwrap(),
            Duration::from_secs(120)
        );
        // Past u32 (Mooncake's flags are 64-bit): 58 days in milliseconds.
        assert_eq!(
            parse_duration_in("5000000000", Duration::from_millis(1)).unwrap(),
            Duration::from_secs(5_000_000)
        );
        assert!(parse_duration_in(&u64::MAX.to_string(), Duration::from_secs(1 << 40)).is_err());
    }
}
