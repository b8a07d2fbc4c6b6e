//! How a request to an endpoint ended.

/// The outcome recorded when an [`crate::InFlight`] guard is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A response arrived with this HTTP status.
    Status(u16),
    /// The connection to the endpoint could not be opened.
    ConnectFailed,
    /// The connection was reset or closed before a full response.
    Reset,
    /// No response within the request timeout.
    Timeout,
    /// The caller gave up (client went away); says nothing about the endpoint.
    Cancelled,
}

impl Outcome {
    /// 5xx responses and every gateway-class failure (Envoy counts local
    /// connect errors as 5xx unless told to split them).
    pub fn is_5xx(self) -> bool {
        match self {
            Outcome::Status(s) => (500..600).contains(&s),
            Outcome::ConnectFailed | Outcome::Reset | Outcome::Timeout => true,
            Outcome::Cancelled => false,
        }
    }

    /// 502, 503, 504, and connect failures, resets and timeouts.
    pub fn is_gateway_error(self) -> bool {
        match self {
            Outcome::Status(s) => matches!(s, 502..=504),
            Outcome::ConnectFailed | Outcome::Reset | Outcome::Timeout => true,
            Outcome::Cancelled => false,
        }
    }

    /// A response that says the endpoint works (status below 500).
    pub fn is_success(self) -> bool {
        matches!(self, Outcome::Status(s) if s < 500)
    }

    /// The status class label for metrics: `2xx`..`5xx`, or the failure kind.
    pub fn class(self) -> &'static str {
        match self {
            Outcome::Status(100..=199) => "1xx",
            Outcome::Status(200..=299) => "2xx",
            Outcome::Status(300..=399) => "3xx",
            Outcome::Status(400..=499) => "4xx",
            Outcome::Status(_) => "5xx",
            Outcome::ConnectFailed => "connect_failed",
            Outcome::Reset => "reset",
            Outcome::Timeout => "timeout",
            Outcome::Cancelled => "cancelled",
        }
    }
}
