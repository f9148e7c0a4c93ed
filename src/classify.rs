//! Deciding what an outcome means, ahead of the built-in rules: the [`Classify`] seam
//! that the retry layer, the hedge and the circuit breaker share.
//!
//! By default an answer is judged by its status or its gRPC code (the sets of
//! [`RetryPolicyBuilder::retryable_statuses`](crate::retry::RetryPolicyBuilder::retryable_statuses)
//! and the breaker's failure sets), and an error by what its
//! [`source()`](std::error::Error::source) chain holds (see [`crate::retry`]'s table). A
//! classifier is asked first: an answer from the head of a response, an error for each
//! link of its chain, the outermost first. Where it answers `None`, the built-in rules
//! decide. What the built-in rules settle of an error is not asked: an open circuit or a
//! shed call (never retried), a proof that the request was never processed or never
//! sent, a drain's GOAWAY (retried only with a proof), a body of the caller's that failed.
//!
//! The simple cases are closures on the policy's builder, which only add retries:
//! [`retry_on_response`](crate::retry::RetryPolicyBuilder::retry_on_response) (of answers
//! the status and code sets call permanent) and
//! [`retry_on_error`](crate::retry::RetryPolicyBuilder::retry_on_error) (of errors the
//! built-in rules do not recognise).
//!
//! ```
//! use http::{HeaderMap, StatusCode};
//! use stormguard::classify::{Classify, Failure};
//! use stormguard::sans_io::Class;
//! use stormguard::{CircuitBreaker, RetryPolicy};
//!
//! /// A dependency whose 409 means "a concurrent write won, try again", and whose
//! /// 404s are not its failures but a cold cache that is.
//! struct Inventory;
//!
//! impl Classify for Inventory {
//!     fn response(&self, status: StatusCode, _headers: &HeaderMap) -> Option<Class> {
//!         (status == StatusCode::CONFLICT).then_some(Class::Retryable { after: None })
//!     }
//!
//!     fn error(&self, error: &(dyn std::error::Error + 'static)) -> Option<Failure> {
//!         let text = error.to_string();
//!         text.contains("cache cold").then_some(Failure::Transient)
//!     }
//! }
//!
//! let policy = RetryPolicy::builder().classify(Inventory).build()?;
//! let breaker = CircuitBreaker::builder().classify(Inventory).build()?;
//! # let _ = (policy, breaker);
//! # Ok::<(), stormguard::ConfigError>(())
//! ```
//!
//! # Your own error type
//!
//! The retry layer sees the error type of the service it wraps. A boxed error
//! ([`BoxError`](crate::BoxError)), and the error types of hyper, hyper-util, h2, tonic,
//! `io` and tower's timeout, are looked into (the reqwest middleware boxes reqwest's); an
//! error of another type cannot be (Rust cannot look inside a type it does not know),
//! and is **not retried**: the policy (or the hedge) says so once, with the type's name,
//! in a `tracing` warning. Name the type to
//! [`RetryPolicyBuilder::error_type`](crate::retry::RetryPolicyBuilder::error_type) and
//! its source chain is walked as a boxed error's is, and handed to the classifiers:
//!
//! ```
//! use std::{fmt, io};
//! use stormguard::RetryPolicy;
//!
//! #[derive(Debug)]
//! enum ApiError {
//!     Transport(io::Error),
//! }
//!
//! impl fmt::Display for ApiError {
//!     fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
//!         f.write_str("transport failed")
//!     }
//! }
//!
//! impl std::error::Error for ApiError {
//!     fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
//!         match self {
//!             ApiError::Transport(err) => Some(err),
//!         }
//!     }
//! }
//!
//! // A reset connection under an `ApiError` is now retried (for a GET), as it would be
//! // under a boxed error.
//! let policy = RetryPolicy::builder().error_type::<ApiError>().build()?;
//! # let _ = policy;
//! # Ok::<(), stormguard::ConfigError>(())
//! ```

use std::any::Any;
use std::error::Error;
use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, StatusCode};
use stormguard_core::Class;

use crate::error_class::ErrorClass;

/// What a failed call's error means, as a [`Classify`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// The request never reached the server: retried for any method, and a failure of
    /// the dependency for the breaker (it may be down).
    NotSent,
    /// A transient failure after which the request may have been processed: retried when
    /// the request may be repeated (an idempotent method, an `Idempotency-Key`), and a
    /// failure for the breaker.
    Transient,
    /// Not retried, and not the dependency's failure (the caller's own doing, or a
    /// failure that will not change).
    Permanent,
}

/// Decides what an outcome means before the built-in rules do: see the
/// [module docs](self). Both methods default to `None` (the built-in rules decide).
///
/// For the breaker, an answer's [`Class::Retryable`] and [`Class::DontRetry`] are the
/// dependency's failures, [`Class::Success`] a success, [`Class::Permanent`] not counted
/// (as a 4xx is not); an error's [`Failure::Permanent`] is not counted, the others are
/// failures. For the retry, a [`Class::Retryable`] answer of a gRPC call is retried
/// whatever its method, as gRPC's retryable codes are (gRFC A6); of an HTTP request, if
/// the request may be repeated.
pub trait Classify: Send + Sync + 'static {
    /// The class of an answer, from the head of the response; `None`: the status and
    /// code sets decide.
    fn response(&self, status: StatusCode, headers: &HeaderMap) -> Option<Class> {
        let _ = (status, headers);
        None
    }

    /// What an error means; asked of each link of its source chain, the outermost
    /// first, until one answers. `None` for every link: the built-in rules decide.
    fn error(&self, error: &(dyn Error + 'static)) -> Option<Failure> {
        let _ = error;
        None
    }
}

/// The classifiers of a policy, a breaker or a hedge: the user's, asked before the
/// built-in rules; the closures, asked only of what the built-in rules would not retry;
/// and the error types named to it.
#[derive(Clone, Default)]
pub(crate) struct Classifiers {
    custom: Vec<Arc<dyn Classify>>,
    retry_responses: Vec<Arc<ResponsePredicate>>,
    retry_errors: Vec<Arc<ErrorPredicate>>,
    error_types: Vec<ErrorType>,
}

/// `retry_on_response`'s closure.
type ResponsePredicate = dyn Fn(StatusCode, &HeaderMap) -> bool + Send + Sync;
/// `retry_on_error`'s closure.
type ErrorPredicate = dyn Fn(&(dyn Error + 'static)) -> bool + Send + Sync;

/// Finds a named error type behind `dyn Any`.
type ErrorType = for<'a> fn(&'a dyn Any) -> Option<&'a (dyn Error + 'static)>;

fn downcast<E: Error + 'static>(any: &dyn Any) -> Option<&(dyn Error + 'static)> {
    any.downcast_ref::<E>()
        .map(|err| err as &(dyn Error + 'static))
}

impl fmt::Debug for Classifiers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Classifiers")
            .field("custom", &self.custom.len())
            .field("retry_responses", &self.retry_responses.len())
            .field("retry_errors", &self.retry_errors.len())
            .field("error_types", &self.error_types.len())
            .finish()
    }
}

/// Whether the built-in rules' class of an error settles the matter whatever a
/// classifier says: the crate's own signals (an open circuit, a shed call), a proof that
/// the request was never processed or never sent, a drain's GOAWAY (retried only with a
/// proof), and the caller's own failure.
fn settled(class: ErrorClass) -> bool {
    matches!(
        class,
        ErrorClass::CircuitOpen
            | ErrorClass::Shed
            | ErrorClass::Unprocessed
            | ErrorClass::NotSent
            | ErrorClass::Drained
            | ErrorClass::Local
    )
}

impl Classifiers {
    pub(crate) fn push(&mut self, classify: impl Classify) {
        self.custom.push(Arc::new(classify));
    }

    pub(crate) fn retry_on_response(
        &mut self,
        retry: impl Fn(StatusCode, &HeaderMap) -> bool + Send + Sync + 'static,
    ) {
        self.retry_responses.push(Arc::new(retry));
    }

    pub(crate) fn retry_on_error(
        &mut self,
        retry: impl Fn(&(dyn Error + 'static)) -> bool + Send + Sync + 'static,
    ) {
        self.retry_errors.push(Arc::new(retry));
    }

    pub(crate) fn error_type<E: Error + 'static>(&mut self) {
        self.error_types.push(downcast::<E>);
    }

    /// Whether a classifier of the user's was given (nothing is asked without one).
    #[inline]
    pub(crate) fn any(&self) -> bool {
        !self.custom.is_empty()
    }

    /// Whether anything here looks at an answer's head.
    pub(crate) fn reads_answers(&self) -> bool {
        !self.custom.is_empty() || !self.retry_responses.is_empty()
    }

    /// Whether a plain success (a 2xx without `grpc-status`) stays one: no classifier of
    /// the user's says otherwise. One comparison without a classifier.
    #[inline]
    pub(crate) fn keeps_success(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        self.custom.is_empty()
            || matches!(self.response(status, headers), None | Some(Class::Success))
    }

    /// What the user's classifiers say of an answer.
    pub(crate) fn response(&self, status: StatusCode, headers: &HeaderMap) -> Option<Class> {
        self.custom
            .iter()
            .find_map(|classify| classify.response(status, headers))
    }

    /// `class`, the built-in rules' for an answer, or a transient failure if it is
    /// permanent and a `retry_on_response` closure says to retry it.
    pub(crate) fn widen(&self, class: Class, status: StatusCode, headers: &HeaderMap) -> Class {
        if class == Class::Permanent && self.retry_responses.iter().any(|f| f(status, headers)) {
            Class::Retryable { after: None }
        } else {
            class
        }
    }

    /// `err` as a `std` error: a type the crate knows, or one named to it.
    pub(crate) fn as_error<'a, E: 'static>(&self, err: &'a E) -> Option<&'a (dyn Error + 'static)> {
        crate::error_class::as_std_error(err).or_else(|| {
            let any = err as &dyn Any;
            self.error_types.iter().find_map(|found| found(any))
        })
    }

    /// What the user's classifiers say of an error's chain, the outermost link first.
    pub(crate) fn error(&self, err: &(dyn Error + 'static)) -> Option<Failure> {
        if self.custom.is_empty() {
            return None;
        }
        crate::error_class::sources(err)
            .take(64)
            .find_map(|link| self.custom.iter().find_map(|classify| classify.error(link)))
    }

    /// How the retry layer reads an error: the built-in rules where they settle the
    /// matter (see [`settled`]), else the user's classifiers, else the built-in rules,
    /// widened by the `retry_on_error` closures; `None` when the error's type cannot be
    /// looked into.
    pub(crate) fn classify_error<E: 'static>(&self, err: &E) -> Option<ErrorClass> {
        let err = self.as_error(err)?;
        let builtin = crate::error_class::classify_chain(err);
        if settled(builtin) {
            return Some(builtin);
        }
        Some(match self.error(err) {
            Some(Failure::NotSent) => ErrorClass::NotSent,
            Some(Failure::Transient) => ErrorClass::MaybeProcessed,
            Some(Failure::Permanent) => ErrorClass::Local,
            None if builtin == ErrorClass::Unknown && self.retried_error(err) => {
                ErrorClass::MaybeProcessed
            }
            None => builtin,
        })
    }

    /// Whether a `retry_on_error` closure says to retry a link of `err`'s chain.
    fn retried_error(&self, err: &(dyn Error + 'static)) -> bool {
        !self.retry_errors.is_empty()
            && crate::error_class::sources(err)
                .take(64)
                .any(|link| self.retry_errors.iter().any(|f| f(link)))
    }
}
