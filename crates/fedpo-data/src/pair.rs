//! The unit of preference data.

use serde::{Deserialize, Serialize};

/// A prompt with a preferred (`chosen`) and a dispreferred (`rejected`) response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreferencePair {
    /// The context both responses answer.
    pub prompt: String,
    /// The preferred response (without the prompt).
    pub chosen: String,
    /// The dispreferred response (without the prompt).
    pub rejected: String,
    /// A grouping key such as SHP's subreddit, used to partition by key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
}
