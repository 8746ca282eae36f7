// gpusnap-controller: the node-local controller as its own program (docs/kubernetes.md). The
// same Controller can run inside the node agent; this binary runs it beside the agent, talking
// to the agent's socket, and is what the tests start against their local API server.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "common/args.h"
#include "gpusnap/error.h"
#include "kube/controller.h"

using gpusnap::Error;
using gpusnap::ErrorKind;
namespace kube = gpusnap::kube;

namespace {

const char* const kUsage =
    "usage: gpusnap-controller --node NAME [options]\n"
    "\n"
    "Watches GpuSnapshots and the pods of one node and drives the node's gpusnap agent.\n"
    "\n"
    "  --node NAME            this node's name (default: $NODE_NAME)\n"
    "  --api-server URL       the API server (default: in-cluster, from the service account)\n"
    "  --token-file FILE      bearer token for --api-server\n"
    "  --ca-file FILE         the API server's CA for --api-server https://...\n"
    "  --agent-socket PATH    the agent's Unix socket (default /run/gpusnap/agent.sock)\n"
    "  --agent-url URL        the agent over TCP instead (with --agent-token-file)\n"
    "  --agent-token-file F   bearer token for --agent-url\n"
    "  --runtime-root DIR     runc's state dir of the node's runtime (default: found\n"
    "                         by the agent from the container id)\n"
    "  --control-root DIR     host dir of launched pods' handshake dirs (default "
    "/run/gpusnap/control)\n"
    "  --namespace NS         watch one namespace only (default: all)\n"
    "  --poll-ms N            how often running operations are followed (default 2000)\n"
    "  --alive-file FILE      touched at least once per --poll-ms while the worker loop\n"
    "                         turns, for a liveness probe that reads its age\n"
    "  --json                 errors as JSON\n"
    "  --version              show the version\n";

}  // namespace

int main(int argc, char** argv) {
  bool json_errors = false;
  try {
    kube::ControllerOptions options;
    kube::AgentEndpoint agent;
    std::string api_server, token_file, ca_file;
    if (const char* n = std::getenv("NODE_NAME"))
      options.node = n;  // NOLINT(concurrency-mt-unsafe)
    std::vector<std::string> args(argv + 1, argv + argc);
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= args.size()) {
          throw Error(ErrorKind::kUsage, a + " needs a value", "see gpusnap-controller --help");
        }
        return args[++i];
      };
      if (a == "--help" || a == "-h") {
        std::cout << kUsage;
        return 0;
      }
      if (a == "--version") {
        std::cout << "gpusnap-controller " << GPUSNAP_VERSION << "\n";
        return 0;
      }
      if (a == "--json")
        json_errors = true;
      else if (a == "--node")
        options.node = value();
      else if (a == "--api-server")
        api_server = value();
      else if (a == "--token-file")
        token_file = value();
      else if (a == "--ca-file")
        ca_file = value();
      else if (a == "--agent-socket")
        agent.socket = value();
      else if (a == "--agent-url")
        agent.url = value();
      else if (a == "--agent-token-file")
        agent.token_file = value();
      else if (a == "--runtime-root")
        options.runtime_root = value();
      else if (a == "--control-root")
        options.control_root = value();
      else if (a == "--alive-file")
        options.alive_file = value();
      else if (a == "--namespace")
        options.namespace_ = value();
      else if (a == "--poll-ms")
        options.poll = std::chrono::milliseconds(
            gpusnap::args::whole_number(a, value(), 10, 600000, "see gpusnap-controller --help"));
      else
        throw Error(ErrorKind::kUsage, "unknown option " + a, "see gpusnap-controller --help");
    }
    if (options.node.empty()) {
      throw Error(ErrorKind::kUsage, "no node name",
                  "give --node NAME, or NODE_NAME from the downward API (spec.nodeName)");
    }
    kube::ApiConfig api;
    if (api_server.empty()) {
      api = kube::ApiConfig::in_cluster();
    } else {
      if (!token_file.empty() && !std::filesystem::exists(token_file)) {
        throw Error(ErrorKind::kUsage, "no token file " + token_file,
                    "give --token-file a file holding the bearer token");
      }
      api.server = api_server;
      api.token_file = token_file;
      api.ca_file = ca_file;
    }
    kube::HttpAgentClient client(agent);
    kube::Controller controller(api, client, options);

    // SIGTERM and SIGINT are blocked before any thread starts (threads inherit the mask) and
    // taken synchronously here: no handler, no flag, no race between a check and a wait.
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGTERM);
    sigaddset(&stop_signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    controller.start();
    std::fprintf(stderr, "gpusnap-controller: watching for node %s\n", options.node.c_str());
    int sig = 0;
    sigwait(&stop_signals, &sig);
    controller.stop();
    return 0;
  } catch (const Error& e) {
    if (json_errors) {
      std::cout << nlohmann::json{{"error",
                                   {{"kind", Error::kind_name(e.kind())},
                                    {"message", e.what()},
                                    {"hint", e.hint()},
                                    {"exit_code", e.exit_code()}}}}
                       .dump()
                << "\n";
    } else {
      std::cerr << "gpusnap-controller: error: " << e.one_line() << "\n";
    }
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << "gpusnap-controller: error: " << e.what() << "\n";
    return 1;
  }
}
