//! A small typed client of the registration API, for `meshless up`, the
//! benchmarks and tests: one method per route, replies decoded into the
//! types of [`crate::api`], refusals returned with their status and text.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api::{
    BulkInput, EndpointInput, ErrorReply, RenewReply, ServiceInput, ServiceList, ServiceView,
    VersionReply,
};

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No answer: connection refused, reset, or a malformed request.
    #[error("{method} {path}: {message}")]
    Transport {
        method: Method,
        path: String,
        message: String,
    },
    /// The control plane refused: its status and `error` text.
    #[error("{method} {path}: {status}: {error}")]
    Refused {
        method: Method,
        path: String,
        status: StatusCode,
        error: String,
    },
    /// The reply was not what the route returns.
    #[error("{method} {path}: unexpected reply: {message}")]
    Decode {
        method: Method,
        path: String,
        message: String,
    },
}

/// A client of one control plane's registration API.
#[derive(Debug, Clone)]
pub struct ApiClient {
    http: Client<HttpConnector, Full<Bytes>>,
    base: String,
    token: Option<String>,
}

/// `ns/name` as a path; both parts are passed through as given.
fn service_path(key: &str) -> String {
    format!("/v1/services/{key}")
}

impl ApiClient {
    /// A client of the API at `addr` (plain HTTP), without a token.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            http: Client::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{addr}"),
            token: None,
        }
    }

    /// Sends `Authorization: Bearer TOKEN` on every call.
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Sends `body` as is: the status and the body of the reply. For tests
    /// of malformed requests; the typed methods are built on it.
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        body: impl Into<Bytes>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let transport = |message: String| ClientError::Transport {
            method: method.clone(),
            path: path.to_owned(),
            message,
        };
        let mut req = Request::builder()
            .method(method.clone())
            .uri(format!("{}{path}", self.base))
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(t) = &self.token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let req = req
            .body(Full::new(body.into()))
            .map_err(|e| transport(e.to_string()))?;
        let resp = self
            .http
            .request(req)
            .await
            .map_err(|e| transport(e.to_string()))?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| transport(e.to_string()))?
            .to_bytes();
        Ok((status, bytes))
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
    ) -> Result<T, ClientError> {
        let decode = |message: String| ClientError::Decode {
            method: method.clone(),
            path: path.to_owned(),
            message,
        };
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| decode(e.to_string()))?,
            None => Vec::new(),
        };
        let (status, reply) = self.raw(method.clone(), path, bytes).await?;
        if !status.is_success() {
            let error = serde_json::from_slice::<ErrorReply>(&reply)
                .map(|r| r.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&reply).into_owned());
            return Err(ClientError::Refused {
                method,
                path: path.to_owned(),
                status,
                error,
            });
        }
        serde_json::from_slice(&reply).map_err(|e| decode(e.to_string()))
    }

    /// `GET /ready`: Ok once the control plane serves.
    pub async fn ready(&self) -> Result<(), ClientError> {
        self.call::<serde_json::Value>(Method::GET, "/ready", None::<&()>)
            .await
            .map(drop)
    }

    /// `GET /metrics`: the OpenMetrics text.
    pub async fn metrics(&self) -> Result<String, ClientError> {
        let (status, body) = self.raw(Method::GET, "/metrics", Bytes::new()).await?;
        if !status.is_success() {
            return Err(ClientError::Refused {
                method: Method::GET,
                path: "/metrics".into(),
                status,
                error: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// `GET /v1/services`.
    pub async fn services(&self) -> Result<ServiceList, ClientError> {
        self.call(Method::GET, "/v1/services", None::<&()>).await
    }

    /// `GET /v1/services/NS/NAME` for `key` = `NS/NAME`.
    pub async fn service(&self, key: &str) -> Result<ServiceView, ClientError> {
        self.call(Method::GET, &service_path(key), None::<&()>)
            .await
    }

    /// `PUT /v1/services/NS/NAME`: creates or updates; returns the version.
    pub async fn put_service(&self, key: &str, input: &ServiceInput) -> Result<u64, ClientError> {
        let r: VersionReply = self
            .call(Method::PUT, &service_path(key), Some(input))
            .await?;
        Ok(r.version)
    }

    /// `DELETE /v1/services/NS/NAME`.
    pub async fn delete_service(&self, key: &str) -> Result<u64, ClientError> {
        let r: VersionReply = self
            .call(Method::DELETE, &service_path(key), None::<&()>)
            .await?;
        Ok(r.version)
    }

    /// `PUT /v1/services/NS/NAME/endpoints/ID` with `ID` = `input.id`.
    pub async fn put_endpoint(&self, key: &str, input: &EndpointInput) -> Result<u64, ClientError> {
        let path = format!("{}/endpoints/{}", service_path(key), input.id);
        let r: VersionReply = self.call(Method::PUT, &path, Some(input)).await?;
        Ok(r.version)
    }

    /// `DELETE /v1/services/NS/NAME/endpoints/ID`.
    pub async fn delete_endpoint(&self, key: &str, id: &str) -> Result<u64, ClientError> {
        let path = format!("{}/endpoints/{id}", service_path(key));
        let r: VersionReply = self.call(Method::DELETE, &path, None::<&()>).await?;
        Ok(r.version)
    }

    /// `POST /v1/services/NS/NAME/endpoints`: puts and deletes as one write.
    pub async fn bulk(&self, key: &str, input: &BulkInput) -> Result<u64, ClientError> {
        let path = format!("{}/endpoints", service_path(key));
        let r: VersionReply = self.call(Method::POST, &path, Some(input)).await?;
        Ok(r.version)
    }

    /// `POST /v1/services/NS/NAME/endpoints/ID/renew`: restarts the TTL.
    pub async fn renew(&self, key: &str, id: &str) -> Result<(), ClientError> {
        let path = format!("{}/endpoints/{id}/renew", service_path(key));
        let _: RenewReply = self.call(Method::POST, &path, None::<&()>).await?;
        Ok(())
    }
}
