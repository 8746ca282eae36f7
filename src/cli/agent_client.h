// `gpusnap --agent SOCKET COMMAND ...`: the CLI as a client of gpusnap-agent (src/agent). The
// request goes to the agent over its Unix socket; the operation is followed to its end, with
// progress on a terminal, and the result is printed and the exit code returned exactly as the
// direct command would.
//
// The client speaks plain HTTP/1.1 over the socket by itself, without an HTTP library: the
// gpusnap binary travels to hosts of other distributions (the GPU machines, container images),
// where only glibc can be expected.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/args.h"

namespace gpusnap::cli {

inline constexpr const char* kDefaultAgentSocket = "/run/gpusnap/agent.sock";
inline constexpr const char* kDefaultStorage = "/var/lib/gpusnap/snapshots";
inline constexpr const char* kAgentEnv = "GPUSNAP_AGENT";

// Where a command runs: here, or through the agent at `socket`.
struct AgentChoice {
  std::string socket;      // empty: here
  bool from_flag = false;  // --agent was given (not only $GPUSNAP_AGENT)
  // Whether `command` goes to the agent. A command the agent does not serve runs here when the
  // agent comes from the environment, and is a usage error (Error kUsage) with --agent.
  bool wanted(const std::string& command) const;
};

// Takes a leading `--agent SOCKET` (or `--agent=SOCKET`) off `argv`; without one, reads
// $GPUSNAP_AGENT. Throws Error(kUsage) when --agent lacks its value.
AgentChoice take_agent_flag(std::vector<std::string>& argv);

// Runs the command `args.command()` through the agent; returns the exit code. Throws Error as
// the direct command would (with the agent's error kind and message), or kEnvironment when the
// agent cannot be reached.
int run_through_agent(const std::string& socket, const args::Args& args);

// One HTTP exchange with the agent over its Unix socket.
struct AgentReply {
  int status = 0;
  std::string body;
};
AgentReply agent_request(const std::string& socket, const std::string& method,
                         const std::string& target, const std::string& body = {});

// The agent's answer to GET /v1/healthz: {"ok", "version", "node"}, which its HTTP threads give
// only while they serve. `gpusnap --agent SOCKET version` prints it; the DaemonSet's probes run
// that. Throws Error(kEnvironment) when the agent cannot be reached.
nlohmann::json agent_health(const std::string& socket);

}  // namespace gpusnap::cli
