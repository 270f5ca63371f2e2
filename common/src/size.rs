//! Human byte sizes ("4GiB", "512 MB", "1048576") for flags and config files. Every unit is a
//! power of 1024: KB, MB, GB and TB too (and K, M, G, T), as Mooncake's configs read them, so
//! `global_segment_size="4GB"` asks for the same memory here as there.

use std::{fmt, str::FromStr};

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: expected a number with an optional unit B, KB, KiB, MB, MiB, GB, GiB, TB or TiB (e.g. \"4GiB\")")]
pub struct SizeError {
    input: String,
}

const UNITS: &[(&str, u64)] = &[
    ("b", 1),
    ("k", 1 << 10),
    ("kb", 1 << 10),
    ("kib", 1 << 10),
    ("m", 1 << 20),
    ("mb", 1 << 20),
    ("mib", 1 << 20),
    ("g", 1 << 30),
    ("gb", 1 << 30),
    ("gib", 1 << 30),
    ("t", 1 << 40),
    ("tb", 1 << 40),
    ("tib", 1 << 40),
];

impl ByteSize {
    pub const fn bytes(self) -> u64 {
        self.0
    }

    pub const fn kib(n: u64) -> Self {
        ByteSize(n << 10)
    }

    pub const fn mib(n: u64) -> Self {
        ByteSize(n << 20)
    }

    pub const fn gib(n: u64) -> Self {
        ByteSize(n << 30)
    }

    pub fn parse(input: &str) -> Result<Self, SizeError> {
        let err = || SizeError {
            input: input.to_string(),
        };
        let s = input.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (number, unit) = s.split_at(split);
        let unit = unit.trim().to_ascii_lowercase();
        let mult = if unit.is_empty() {
            1
        } else {
            UNITS
                .iter()
                .find(|(u, _)| *u == unit)
                .map(|(_, m)| *m)
                .ok_or_else(err)?
        };
        if number.is_empty() {
            return Err(err());
        }
        if let Ok(n) = number.parse::<u64>() {
            return n.checked_mul(mult).map(ByteSize).ok_or_else(err);
        }
        let f: f64 = number.parse().map_err(|_| err())?;
        let bytes = f * mult as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 || bytes.fract() != 0.0 {
            return Err(err());
        }
        Ok(ByteSize(bytes as u64))
    }
}

impl FromStr for ByteSize {
    type Err = SizeError;
    fn from_str(s: &str) -> Result<Self, SizeError> {
        Self::parse(s)
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit that represents the size exactly, so the output parses back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (unit, mult) in [
            ("TiB", 1u64 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ] {
            if self.0 >= mult && self.0.is_multiple_of(mult) {
                return write!(f, "{}{unit}", self.0 / mult);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte count or a size string such as \"4GiB\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom("size must not be negative"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                ByteSize::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(ByteSize::parse("4GiB").unwrap().bytes(), 4 << 30);
        assert_eq!(ByteSize::parse("4 gib").unwrap().bytes(), 4 << 30);
        // As Mooncake reads them: binary.
        assert_eq!(ByteSize::parse("512MB").unwrap().bytes(), 512 << 20);
        assert_eq!(ByteSize::parse("4GB").unwrap().bytes(), 4 << 30);
        assert_eq!(ByteSize::parse("1.5GB").unwrap().bytes(), 3 << 29);
        assert_eq!(ByteSize::parse("1048576").unwrap().bytes(), 1 << 20);
        assert_eq!(ByteSize::parse("1.5KiB").unwrap().bytes(), 1536);
        assert_eq!(ByteSize::parse("64k").unwrap().bytes(), 64 << 10);
        for bad in ["", "GiB", "4XB", "-1", "1.3B", "99999999999999TiB"] {
            assert!(ByteSize::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn display_round_trips() {
        for n in [0u64, 1, 1000, 1024, 3 << 20, (1 << 30) + 1, 5 << 40] {
            let s = ByteSize(n).to_string();
            assert_eq!(ByteSize::parse(&s).unwrap().bytes(), n, "{s}");
        }
        assert_eq!(ByteSize::gib(4).to_string(), "4GiB");
    }
}
