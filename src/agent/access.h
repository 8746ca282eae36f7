// Who may call the agent and what an Error becomes in HTTP: the bearer-token check of the TCP
// listener and the status of each error kind. (The Unix socket's check is the kernel's: the
// socket file's owner, group and mode.)
#pragma once

#include <string_view>

#include "gpusnap/error.h"

namespace gpusnap::agent {

// Whether `given` equals `expected`, in a time that depends only on `expected`'s length: a
// caller timing refusals learns nothing about how much of its guess was right. An empty
// `expected` matches nothing.
bool token_matches(std::string_view given, std::string_view expected);

// Whether an Authorization header's value is "Bearer TOKEN" (the scheme in any case) with
// the expected token.
bool bearer_matches(std::string_view authorization, std::string_view expected);

// The HTTP status for an Error the agent answers with: 400 usage, 404 not found, 422 bad
// artifact, 501 a request this build cannot carry out (the only environment failure at
// request time, see request.h), 500 anything else.
int http_status(const Error& error);

}  // namespace gpusnap::agent
