// The agent's request parsing, the request-to-options seam, and its access checks: pure
// functions, tested with the exact messages a caller sees.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "agent/access.h"
#include "agent/request.h"
#include "testing/unit.h"

namespace gpusnap::agent {
namespace {

using nlohmann::json;
using testing::catch_error;

Error checkpoint_error(const json& body) {
  return catch_error([&] { parse_checkpoint_request(body); });
}

Error restore_error(const json& body) {
  return catch_error([&] { parse_restore_request(body); });
}

TEST(CheckpointRequest, TakesPidAndDefaultsToLeavingTheSourceRunning) {
  auto r = parse_checkpoint_request({{"artifact", "llm"}, {"pid", 1234}});
  EXPECT_EQ(r.artifact, "llm");
  EXPECT_EQ(r.pid, 1234);
  EXPECT_TRUE(r.leave_running);
  EXPECT_FALSE(r.container);
  EXPECT_EQ(to_json(r), (json{{"artifact", "llm"}, {"pid", 1234}, {"leave_running", true}}));
}

TEST(CheckpointRequest, TakesAContainerWithItsRuntimeRoot) {
  auto r = parse_checkpoint_request(
      {{"artifact", "llm"}, {"container", {{"id", "abc"}}}, {"leave_running", false}});
  ASSERT_TRUE(r.container);
  EXPECT_EQ(r.container->id, "abc");
  EXPECT_EQ(r.container->runtime_root, "");  // found by the engine
  EXPECT_FALSE(r.leave_running);
  r = parse_checkpoint_request(
      {{"artifact", "llm"}, {"container", {{"id", "abc"}, {"runtime_root", "/run/x"}}}});
  EXPECT_EQ(r.container->runtime_root, "/run/x");
  r = parse_checkpoint_request(
      {{"artifact", "llm"}, {"container", {{"id", "abc"}, {"runtime_root", ""}}}});
  EXPECT_EQ(r.container->runtime_root, "");  // found by the engine
}

TEST(CheckpointRequest, RefusesEachMistakeByName) {
  EXPECT_STREQ(checkpoint_error({{"artifact", "a"}, {"pid", 1}, {"leave_runing", true}}).what(),
               "unknown field \"leave_runing\" in a checkpoint request");
  EXPECT_EQ(checkpoint_error({{"artifact", "a"}, {"pid", 1}, {"x", 1}}).hint(),
            "the fields are: artifact, container, handshake_timeout_s, leave_running, pid");
  EXPECT_STREQ(checkpoint_error({{"artifact", "a"}}).what(),
               "a checkpoint request needs \"pid\" or \"container\"");
  EXPECT_STREQ(
      checkpoint_error({{"artifact", "a"}, {"pid", 1}, {"container", {{"id", "c"}}}}).what(),
      "a checkpoint request names either \"pid\" or \"container\", not both");
  EXPECT_STREQ(checkpoint_error({{"pid", 1}}).what(),
               "a checkpoint request needs \"artifact\", the snapshot's name");
  EXPECT_STREQ(checkpoint_error({{"artifact", "a"}, {"pid", "12"}}).what(),
               "\"pid\" must be a whole number from 1 to 4194304, not \"12\"");
  EXPECT_STREQ(checkpoint_error({{"artifact", "a"}, {"pid", 0}}).what(),
               "\"pid\" must be a whole number from 1 to 4194304, not 0");
  EXPECT_STREQ(checkpoint_error({{"artifact", "a"}, {"pid", 1}, {"leave_running", 1}}).what(),
               "\"leave_running\" must be true or false, not 1");
  EXPECT_STREQ(checkpoint_error({{"artifact", "a"}, {"pid", 1}, {"handshake_timeout_s", 0}}).what(),
               "\"handshake_timeout_s\" must be a whole number from 1 to 86400, not 0");
  EXPECT_STREQ(
      checkpoint_error({{"artifact", "a"}, {"container", {{"id", "c"}, {"root", "/"}}}}).what(),
      "unknown field \"root\" in \"container\"");
  EXPECT_STREQ(
      checkpoint_error({{"artifact", "a"}, {"container", {{"runtime_root", "/r"}}}}).what(),
      "\"container\" needs \"id\", the container's id");
  EXPECT_STREQ(
      checkpoint_error({{"artifact", "a"}, {"container", {{"id", "c"}, {"runtime_root", "r"}}}})
          .what(),
      "\"runtime_root\" in \"container\" must be an absolute path, not 'r'");
  EXPECT_EQ(checkpoint_error({{"artifact", "a"}}).kind(), ErrorKind::kUsage);
}

TEST(ArtifactName, IsAPlainNameInTheStorage) {
  for (const char* good : {"llm", "llm-7b.v2", "a_b", "x..y"}) {
    EXPECT_NO_THROW(check_artifact_name(good)) << good;
  }
  auto message = [](const std::string& name) {
    return std::string(catch_error([&] { check_artifact_name(name); }).what());
  };
  EXPECT_EQ(message("a/b"), "artifact name 'a/b' is a path, not a name");
  EXPECT_EQ(message("/etc"), "artifact name '/etc' is a path, not a name");
  EXPECT_EQ(message("../x"), "artifact name '../x' is a path, not a name");
  EXPECT_EQ(message(".."), "artifact name '..' is not a name");
  EXPECT_EQ(message("."), "artifact name '.' is not a name");
  EXPECT_EQ(message(".llm.staging-1-abc"),
            "artifact name '.llm.staging-1-abc' is hidden: hidden names are for staging");
  EXPECT_EQ(message(""), "the artifact name is empty");
  EXPECT_EQ(message(std::string(256, 'a')), "the artifact name is longer than 255 bytes");
  EXPECT_EQ(message(std::string("a\0b", 3)), "the artifact name contains a control character");
  EXPECT_EQ(message("a\nb"), "the artifact name contains a control character");
}

TEST(RestoreRequest, TakesEveryField) {
  auto r = parse_restore_request({{"artifact", "llm"},
                                  {"replicas", 3},
                                  {"settings", {{"role", "replica"}}},
                                  {"gpu_map", {"0=1"}},
                                  {"publish", {"8000", "127.0.0.1:9000:8000"}},
                                  {"handshake_timeout_s", 30}});
  EXPECT_EQ(r.replicas, 3);
  EXPECT_EQ(r.settings.at("role"), "replica");
  EXPECT_EQ(r.gpu_map, std::vector<std::string>{"0=1"});
  EXPECT_EQ(r.publish.size(), 2u);
  EXPECT_EQ(r.handshake_timeout_s, 30);
  EXPECT_EQ(parse_restore_request({{"artifact", "llm"}}).replicas, 1);
}

TEST(RestoreRequest, RefusesEachMistakeByName) {
  EXPECT_STREQ(restore_error({{"artifact", "a"}, {"replica", 2}}).what(),
               "unknown field \"replica\" in a restore request");
  EXPECT_STREQ(restore_error({{"artifact", "a"}, {"replicas", 0}}).what(),
               "\"replicas\" must be a whole number from 1 to 1024, not 0");
  EXPECT_STREQ(restore_error({{"artifact", "a"}, {"settings", {{"k", 1}}}}).what(),
               "\"settings\" must map names to strings; \"k\" is 1");
  EXPECT_STREQ(restore_error({{"artifact", "a"}, {"gpu_map", {"0"}}}).what(),
               "bad gpu_map entry '0'");
  EXPECT_STREQ(restore_error({{"artifact", "a"}, {"publish", "8000"}}).what(),
               "\"publish\" must be a list of strings");
  EXPECT_STREQ(
      restore_error({{"artifact", "a"}, {"replicas", 2}, {"into_container", {{"id", "c"}}}}).what(),
      "a restore into a container starts one copy, not 2");
  EXPECT_STREQ(restore_error({{"artifact", "a/../b"}}).what(),
               "artifact name 'a/../b' is a path, not a name");
}

TEST(RestoreRequest, TakesTheReferenceOfASnapshotThisNodeMayNotHold) {
  const std::string ref = "oci://registry:5000/snapshots@sha256:" + std::string(64, 'a');
  auto r = parse_restore_request({{"artifact", "default.llm"}, {"reference", ref}});
  ASSERT_TRUE(r.reference);
  EXPECT_EQ(*r.reference, ref);
  EXPECT_EQ(to_json(r)["reference"], ref);
  EXPECT_FALSE(to_json(parse_restore_request({{"artifact", "a"}})).contains("reference"));
  EXPECT_STREQ(restore_error({{"artifact", "a"}, {"reference", 7}}).what(),
               "\"reference\" in a restore request must be a string");
  EXPECT_STREQ(restore_error({{"artifact", "a"}, {"reference", "/var/lib/x"}}).what(),
               "\"reference\" in a restore request must be "
               "oci://HOST[:PORT]/REPO[:TAG|@sha256:HEX], not \"/var/lib/x\"");
  EXPECT_STREQ(
      restore_error({{"artifact", "a"}, {"reference", "oci://h/" + std::string(1100, 'r')}}).what(),
      "\"reference\" in a restore request is longer than 1024 bytes");
}

Error prefetch_error(const json& body) {
  return catch_error([&] { parse_prefetch_request(body); });
}

TEST(PrefetchRequest, NamesTheSnapshotByReferenceOrByName) {
  auto by_ref = parse_prefetch_request({{"reference", "oci://registry:5000/snapshots:llm"}});
  EXPECT_EQ(by_ref.reference, "oci://registry:5000/snapshots:llm");
  EXPECT_EQ(to_json(by_ref), (json{{"reference", "oci://registry:5000/snapshots:llm"}}));
  auto by_name = parse_prefetch_request({{"artifact", "default.llm"}});
  EXPECT_EQ(by_name.artifact, "default.llm");
  EXPECT_EQ(to_json(by_name), (json{{"artifact", "default.llm"}}));
}

TEST(PrefetchRequest, RefusesEachMistakeByName) {
  EXPECT_STREQ(prefetch_error(json::object()).what(),
               "a prefetch request needs \"reference\" or \"artifact\"");
  EXPECT_STREQ(prefetch_error({{"artifact", "a"}, {"reference", "oci://h/r"}}).what(),
               "a prefetch request names either \"artifact\" or \"reference\", not both");
  EXPECT_STREQ(prefetch_error({{"reference", "oci://h/r"}, {"replicas", 2}}).what(),
               "unknown field \"replicas\" in a prefetch request");
  EXPECT_STREQ(prefetch_error({{"reference", "docker://h/r"}}).what(),
               "\"reference\" in a prefetch request must be "
               "oci://HOST[:PORT]/REPO[:TAG|@sha256:HEX], not \"docker://h/r\"");
  EXPECT_STREQ(prefetch_error({{"artifact", "../x"}}).what(),
               "artifact name '../x' is a path, not a name");
}

TEST(RequestBody, MustBeAJsonObject) {
  EXPECT_EQ(parse_body(R"({"a":1})"), (json{{"a", 1}}));
  EXPECT_STREQ(catch_error([] { parse_body("[1]"); }).what(),
               "the request body must be a JSON object, not [1]");
  auto e = catch_error([] { parse_body("{"); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_EQ(std::string(e.what()).rfind("the request body is not JSON: ", 0), 0u) << e.what();
}

TEST(RequestBody, NestingAndLongValuesAreBoundedInMessages) {
  // 80000 levels crashed the agent (a stack overflow in the error's dump()).
  const std::string deep = std::string(80000, '[') + std::string(80000, ']');
  EXPECT_STREQ(catch_error([&] { parse_body(deep); }).what(),
               "the request body is not JSON: nested deeper than 64 levels");
  // A value quoted in a message is cut short, not dumped whole.
  json settings{{"artifact", "a"}, {"settings", {{"k", json::array({std::string(500, 'x')})}}}};
  const std::string what = catch_error([&] { parse_restore_request(settings); }).what();
  EXPECT_EQ(what,
            "\"settings\" must map names to strings; \"k\" is [\"" + std::string(78, 'x') + "...");
}

TEST(RequestOptions, MapOntoTheEngineInOnePlace) {
  EngineSettings s{"/snap", "/run/x", "/bin/gpusnap", "/criu", std::nullopt};
  auto c = checkpoint_options(
      parse_checkpoint_request(
          {{"artifact", "llm"}, {"pid", 42}, {"leave_running", false}, {"handshake_timeout_s", 5}}),
      s);
  EXPECT_EQ(c.pid, 42);
  EXPECT_EQ(c.output, "/snap/llm");
  EXPECT_FALSE(c.leave_running);
  EXPECT_EQ(c.helper_binary, "/bin/gpusnap");
  EXPECT_EQ(c.criu_path, "/criu");
  EXPECT_EQ(c.run_dir, "/run/x");
  EXPECT_EQ(c.handshake_timeout, std::chrono::seconds(5));
  auto r = restore_options(parse_restore_request({{"artifact", "llm"},
                                                  {"replicas", 2},
                                                  {"publish", {"9000:8000"}},
                                                  {"settings", {{"k", "v"}}}}),
                           s);
  EXPECT_EQ(r.artifact, "/snap/llm");
  EXPECT_EQ(r.replicas, 2);
  ASSERT_EQ(r.publish.size(), 1u);
  EXPECT_EQ(r.publish[0].host_port, 9000);
  EXPECT_EQ(r.publish[0].port, 8000);
  EXPECT_EQ(r.settings.at("k"), "v");
  EXPECT_TRUE(r.verify);
  // A publish form only the engine's parser knows is refused when the options are made.
  auto bad = catch_error([&] {
    restore_options(parse_restore_request({{"artifact", "llm"}, {"publish", {"x:y"}}}), s);
  });
  EXPECT_EQ(bad.kind(), ErrorKind::kUsage);
}

TEST(RequestOptions, ContainerFieldsBecomeTheEnginesContainerOptions) {
  EngineSettings s{"/snap", "/run/gpusnap", "/bin/gpusnap", "", std::nullopt};
  auto co = checkpoint_options(
      parse_checkpoint_request(
          {{"artifact", "llm"}, {"container", {{"id", "c1"}, {"runtime_root", "/run/x"}}}}),
      s);
  ASSERT_TRUE(co.container.has_value());
  EXPECT_EQ(co.container->id, "c1");
  EXPECT_EQ(co.container->runtime_root, "/run/x");
  auto ro = restore_options(
      parse_restore_request({{"artifact", "llm"}, {"into_container", {{"id", "p1"}}}}), s);
  ASSERT_TRUE(ro.into_container.has_value());
  EXPECT_EQ(ro.into_container->id, "p1");
  EXPECT_EQ(ro.into_container->runtime_root, "");  // found by the engine
  EXPECT_EQ(ro.replicas, 1);
}

TEST(Access, TokenMustMatchExactly) {
  EXPECT_TRUE(token_matches("0123456789abcdef", "0123456789abcdef"));
  EXPECT_FALSE(token_matches("0123456789abcdeF", "0123456789abcdef"));
  EXPECT_FALSE(token_matches("0123456789abcde", "0123456789abcdef"));
  EXPECT_FALSE(token_matches("0123456789abcdef0", "0123456789abcdef"));
  EXPECT_FALSE(token_matches("", ""));  // no token configured: nothing matches
  EXPECT_TRUE(bearer_matches("Bearer secret-token", "secret-token"));
  EXPECT_TRUE(bearer_matches("bearer secret-token", "secret-token"));
  EXPECT_FALSE(bearer_matches("Basic secret-token", "secret-token"));
  EXPECT_FALSE(bearer_matches("Bearer ", "secret-token"));
  EXPECT_FALSE(bearer_matches("secret-token", "secret-token"));
}

TEST(Access, EachErrorKindHasItsStatus) {
  EXPECT_EQ(http_status(Error(ErrorKind::kUsage, "")), 400);
  EXPECT_EQ(http_status(Error(ErrorKind::kNotFound, "")), 404);
  EXPECT_EQ(http_status(Error(ErrorKind::kBadArtifact, "")), 422);
  EXPECT_EQ(http_status(Error(ErrorKind::kEnvironment, "")), 501);
  EXPECT_EQ(http_status(Error(ErrorKind::kInternal, "")), 500);
  EXPECT_EQ(http_status(Error(ErrorKind::kCriu, "")), 500);
}

}  // namespace
}  // namespace gpusnap::agent
