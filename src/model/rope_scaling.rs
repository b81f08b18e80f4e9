//! `rope_scaling` of a Hugging Face config, parsed once, when the config is read, into what the
//! rotary embedding needs (it used to stay raw JSON, checked by building the embedding).

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{json, Value};

/// The supported scalings of the rotary embedding's frequencies.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum RopeScaling {
    /// None: the field absent, `null`, or of type "default".
    #[default]
    Default,
    /// All frequencies divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, smooth in between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

impl RopeScaling {
    pub(crate) fn is_default(&self) -> bool {
        *self == RopeScaling::Default
    }

    /// From the JSON value of the field (`rope_type`, or the older `type`, names the kind).
    pub(crate) fn from_json(value: &Value) -> Result<Self, String> {
        if value.is_null() {
            return Ok(RopeScaling::Default);
        }
        let kind = value
            .get("rope_type")
            .or_else(|| value.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let number = |key: &str| {
            value
                .get(key)
                .and_then(Value::as_f64)
                .ok_or_else(|| format!("rope_scaling of type {kind} needs a number {key}"))
        };
        match kind {
            "default" => Ok(RopeScaling::Default),
            "linear" => Ok(RopeScaling::Linear {
                factor: number("factor")?,
            }),
            "llama3" => Ok(RopeScaling::Llama3 {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_position_embeddings: number("original_max_position_embeddings")?,
            }),
            other => Err(format!(
                "rope_scaling type {other:?} is not supported (default, linear, llama3)"
            )),
        }
    }

    /// The field as Hugging Face configs write it.
    pub(crate) fn to_json(self) -> Value {
        match self {
            RopeScaling::Default => Value::Null,
            RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        }
    }

    /// Applies the scaling to inverse frequencies.
    pub fn scale(&self, inv_freq: &mut [f64]) {
        match *self {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            } => {
                let low_wavelen = original / low;
                let high_wavelen = original / high;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (original / wavelen - low) / (high - low);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
    }
}

impl<'de> Deserialize<'de> for RopeScaling {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        RopeScaling::from_json(&Value::deserialize(d)?).map_err(D::Error::custom)
    }
}

impl Serialize for RopeScaling {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_write_back() {
        let llama3 = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let parsed = RopeScaling::from_json(&llama3).unwrap();
        assert!(matches!(parsed, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        assert_eq!(RopeScaling::from_json(&parsed.to_json()).unwrap(), parsed);
        let old = json!({"type": "linear", "factor": 2.0});
        assert_eq!(
            RopeScaling::from_json(&old).unwrap(),
            RopeScaling::Linear { factor: 2.0 }
        );
        assert_eq!(
            RopeScaling::from_json(&Value::Null).unwrap(),
            RopeScaling::Default
        );
        let e = RopeScaling::from_json(&json!({"rope_type": "yarn", "factor": 4.0})).unwrap_err();
        assert!(e.contains("\"yarn\" is not supported"), "{e}");
        let e = RopeScaling::from_json(&json!({"rope_type": "llama3", "factor": 8.0})).unwrap_err();
        assert!(e.contains("low_freq_factor"), "{e}");
        let mut f = [1.0, 0.5];
        RopeScaling::Linear { factor: 2.0 }.scale(&mut f);
        assert_eq!(f, [0.5, 0.25]);
    }
}
