//! YAML documents into typed values, with the path of the field at fault.

use serde::de::DeserializeOwned;

use crate::field_error::{FieldError, TOP_LEVEL};

/// Parses YAML `text` into `T`. On error: the dotted path of the field at
/// fault (`(top level)` when there is none) and the reason.
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, FieldError> {
    let mut path = String::new();
    serde_saphyr::with_deserializer_from_str(text, |de| {
        serde_path_to_error::deserialize::<_, T>(de).map_err(|e| {
            path = e.path().to_string();
            e.into_inner()
        })
    })
    .map_err(|e| {
        let path = if path.is_empty() || path == "." {
            TOP_LEVEL.to_owned()
        } else {
            path
        };
        FieldError::new(path, e.to_string())
    })
}
