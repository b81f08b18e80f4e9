//! The rotary embedding's settings of a Hugging Face config, parsed once, when the config is
//! read: `rope_parameters` as transformers >= 5 writes it, or the older top-level `rope_theta`
//! and `rope_scaling`.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{json, Map, Value};

/// transformers' `default_theta`, used where a config names no theta.
pub(crate) const DEFAULT_THETA: f64 = 10_000.0;

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
        Self::from_field(value, "rope_scaling")
    }

    /// From the value of the field `field` (`rope_scaling` or `rope_parameters`), naming it in
    /// errors.
    fn from_field(value: &Value, field: &str) -> Result<Self, String> {
        if value.is_null() {
            return Ok(RopeScaling::Default);
        }
        if !value.is_object() {
            return Err(format!("{field} must be an object, found {value}"));
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
                .ok_or_else(|| format!("{field}.{key} must be a number (rope_type {kind:?})"))
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
                "{field}.rope_type = {other:?} is not supported (default, linear, llama3)"
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

    /// For messages: "default", or the field's JSON.
    fn describe(&self) -> String {
        match self {
            RopeScaling::Default => "default".into(),
            other => other.to_json().to_string(),
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

/// The rotary embedding's settings of a model config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RopeSettings {
    pub theta: f64,
    pub scaling: RopeScaling,
}

impl RopeSettings {
    /// From the fields of a config: `rope_parameters` (transformers >= 5) or the older
    /// `rope_theta` and `rope_scaling`; where both forms are present they must agree (transformers
    /// would take one and drop the other without a word).
    pub(crate) fn from_config(config: &Map<String, Value>) -> Result<Self, String> {
        let (settings, partial) = Self::with_partial_rotary(config)?;
        match partial {
            Some((f, field)) if f != 1.0 => Err(format!(
                "{field} = {f} is not supported (the rotary embedding covers whole heads: 1.0)"
            )),
            _ => Ok(settings),
        }
    }

    /// [`RopeSettings::from_config`] for models whose rotary embedding may cover the first
    /// `partial_rotary_factor` of each head (in `rope_parameters` or at the top level, in (0, 1]):
    /// the settings and that factor (1 where absent).
    pub(crate) fn from_config_partial(config: &Map<String, Value>) -> Result<(Self, f64), String> {
        let (settings, partial) = Self::with_partial_rotary(config)?;
        match partial {
            Some((f, field)) if !(f > 0.0 && f <= 1.0) => {
                Err(format!("{field} = {f} must be in (0, 1]"))
            }
            _ => Ok((settings, partial.map_or(1.0, |(f, _)| f))),
        }
    }

    /// The settings and the partial rotary factor with the field it came from, if any.
    #[allow(clippy::type_complexity)]
    fn with_partial_rotary(
        config: &Map<String, Value>,
    ) -> Result<(Self, Option<(f64, &'static str)>), String> {
        let present = |key: &str| config.get(key).filter(|v| !v.is_null());
        let max_positions = present("max_position_embeddings").and_then(Value::as_f64);
        let top_partial = number(present("partial_rotary_factor"), "partial_rotary_factor")?
            .map(|f| (f, "partial_rotary_factor"));
        let old_theta = number(present("rope_theta"), "rope_theta")?;
        let old_scaling = present("rope_scaling")
            .map(|v| scaling_of(v, "rope_scaling", max_positions))
            .transpose()?;
        let Some(params) = present("rope_parameters") else {
            let settings = RopeSettings {
                theta: old_theta.unwrap_or(DEFAULT_THETA),
                scaling: old_scaling.unwrap_or_default(),
            };
            return Ok((settings, top_partial));
        };
        let map = params
            .as_object()
            .ok_or_else(|| format!("rope_parameters must be an object, found {params}"))?;
        if let Some((key, _)) = map.iter().find(|(_, v)| v.is_object()) {
            return Err(format!(
                "rope_parameters.{key}: rotary settings per layer type are not supported (one rope_parameters for every layer)"
            ));
        }
        let field = "rope_parameters.partial_rotary_factor";
        let partial = number(
            map.get("partial_rotary_factor").filter(|v| !v.is_null()),
            field,
        )?
        .map(|f| (f, field))
        .or(top_partial);
        let theta = number(
            map.get("rope_theta").filter(|v| !v.is_null()),
            "rope_parameters.rope_theta",
        )?;
        if let (Some(new), Some(old)) = (theta, old_theta) {
            if new != old {
                return Err(format!(
                    "rope_parameters.rope_theta = {new} and rope_theta = {old} disagree (transformers 5 reads the first, older versions the second): keep one"
                ));
            }
        }
        let scaling = scaling_of(params, "rope_parameters", max_positions)?;
        if let Some(old) = old_scaling.filter(|old| *old != scaling) {
            return Err(format!(
                "rope_parameters ({}) and rope_scaling ({}) disagree (transformers 5 takes rope_scaling, older versions ignore rope_parameters): keep one",
                scaling.describe(),
                old.describe()
            ));
        }
        let settings = RopeSettings {
            theta: theta.or(old_theta).unwrap_or(DEFAULT_THETA),
            scaling,
        };
        Ok((settings, partial))
    }
}

fn number(value: Option<&Value>, field: &str) -> Result<Option<f64>, String> {
    value
        .map(|v| {
            v.as_f64()
                .ok_or_else(|| format!("{field} must be a number, found {v}"))
        })
        .transpose()
}

/// The scaling in `value`; a llama3 scaling without `original_max_position_embeddings` takes
/// `max_position_embeddings`, as transformers does.
fn scaling_of(
    value: &Value,
    field: &str,
    max_positions: Option<f64>,
) -> Result<RopeScaling, String> {
    let mut value = value.clone();
    if let (Some(map), Some(max)) = (value.as_object_mut(), max_positions) {
        let kind = map.get("rope_type").or_else(|| map.get("type"));
        if kind.and_then(Value::as_str) == Some("llama3") {
            map.entry("original_max_position_embeddings")
                .or_insert(json!(max));
        }
    }
    RopeScaling::from_field(&value, field)
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

    fn settings(v: Value) -> Result<RopeSettings, String> {
        RopeSettings::from_config(v.as_object().unwrap())
    }

    #[test]
    fn rope_parameters_and_the_older_keys_read_alike() {
        let new = settings(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}));
        let old = settings(json!({"rope_theta": 1000000}));
        let default = RopeSettings {
            theta: 1e6,
            scaling: RopeScaling::Default,
        };
        assert_eq!((new, old), (Ok(default), Ok(default)));
        assert_eq!(settings(json!({})).unwrap().theta, DEFAULT_THETA);
        // llama3 without original_max_position_embeddings takes max_position_embeddings
        let llama3 = json!({"max_position_embeddings": 8192, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0}});
        let got = settings(llama3).unwrap();
        assert_eq!(got.theta, 500_000.0);
        assert!(matches!(got.scaling,
            RopeScaling::Llama3 { original_max_position_embeddings, .. }
                if original_max_position_embeddings == 8192.0));
        // both forms, agreeing
        let both = json!({"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0},
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}});
        assert_eq!(
            settings(both).unwrap(),
            RopeSettings {
                theta: 1e6,
                scaling: RopeScaling::Linear { factor: 2.0 }
            }
        );
    }

    #[test]
    fn rope_refusals_name_the_fields() {
        for (config, says) in [
            (
                json!({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 1e6}}),
                "rope_parameters.rope_theta = 1000000 and rope_theta = 10000 disagree",
            ),
            (
                json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                    "rope_parameters": {"rope_type": "default"}}),
                "rope_parameters (default) and rope_scaling ({\"rope_type\":\"linear\",\"factor\":2.0}) disagree",
            ),
            (
                json!({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}),
                "rope_parameters.rope_type = \"yarn\" is not supported (default, linear, llama3)",
            ),
            (
                json!({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}),
                "rope_parameters.rope_type = \"dynamic\" is not supported",
            ),
            (
                json!({"rope_scaling": {"type": "longrope"}}),
                "rope_scaling.rope_type = \"longrope\" is not supported",
            ),
            (
                json!({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
                "rope_parameters.partial_rotary_factor = 0.5 is not supported",
            ),
            (
                json!({"partial_rotary_factor": 0.25}),
                "partial_rotary_factor = 0.25 is not supported",
            ),
            (
                json!({"rope_parameters": {"full_attention": {"rope_theta": 1e6},
                    "sliding_attention": {"rope_theta": 1e4}}}),
                "rotary settings per layer type are not supported",
            ),
            (
                json!({"rope_parameters": {"rope_theta": "1e6"}}),
                "rope_parameters.rope_theta must be a number",
            ),
        ] {
            let e = settings(config.clone()).unwrap_err();
            assert!(e.contains(says), "{config}: {e}");
        }
    }

    #[test]
    fn hybrids_read_a_partial_rotary_factor() {
        let partial = |v: Value| RopeSettings::from_config_partial(v.as_object().unwrap());
        let qwen35 = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
            "mrope_interleaved": true}});
        let (rope, factor) = partial(qwen35).unwrap();
        assert_eq!(
            (rope.theta, rope.scaling, factor),
            (1e7, RopeScaling::Default, 0.25)
        );
        assert_eq!(
            partial(json!({"partial_rotary_factor": 0.5})).unwrap().1,
            0.5
        );
        assert_eq!(partial(json!({})).unwrap().1, 1.0);
        let e = partial(json!({"rope_parameters": {"partial_rotary_factor": 0}})).unwrap_err();
        assert_eq!(
            e,
            "rope_parameters.partial_rotary_factor = 0 must be in (0, 1]"
        );
    }
}
