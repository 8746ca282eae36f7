// Registry mirrors read as containers-registries.conf(5) writes them (store/mirrors.h): which
// entry a reference matches, where its mirrors put it, and the files that are refused.
#include <gtest/gtest.h>

#include "common/fs.h"
#include "gpusnap/error.h"
#include "store/mirrors.h"
#include "testing/unit.h"

namespace gpusnap::testing {
namespace {

using store::OciRef;
using store::PullSource;
using store::RegistriesConf;

std::vector<std::string> where(const RegistriesConf& conf, const std::string& ref,
                               bool plain = false) {
  std::vector<std::string> out;
  for (const PullSource& s : conf.sources_for(OciRef::parse(ref), plain)) {
    out.push_back(s.ref.str() + (s.plain_http ? " http" : " https") +
                  (s.mirror ? " mirror" : " origin"));
  }
  return out;
}

constexpr const char* kConf = R"(
unqualified-search-registries = ["docker.io"]

[[registry]]
prefix = "registry.example.com"
location = "registry.example.com"

[[registry.mirror]]
location = "cache.cluster.local:5000"
insecure = true

[[registry.mirror]]
location = "mirror.example.net/pull/through"

[[registry]]
prefix = "registry.example.com/team/models"
location = "models.example.com/team"
mirror-by-digest-only = true

[[registry.mirror]]
location = "cache.cluster.local:5000/models"
insecure = true

[[registry]]
prefix = "*.corp.example"

[[registry.mirror]]
location = "cache.cluster.local:5000"
pull-from-mirror = "tag-only"
insecure = true

[[registry]]
location = "blocked.example.com"
blocked = true
)";

TEST(RegistriesConf, MirrorsComeFirstWithTheReferenceRewrittenUnderTheirLocation) {
  const auto conf = RegistriesConf::parse(kConf, "test.conf");
  EXPECT_EQ(
      where(conf, "oci://registry.example.com/team/snap:v1"),
      (std::vector<std::string>{"oci://cache.cluster.local:5000/team/snap:v1 http mirror",
                                "oci://mirror.example.net/pull/through/team/snap:v1 https mirror",
                                "oci://registry.example.com/team/snap:v1 https origin"}));
}

TEST(RegistriesConf, TheLongestPrefixWinsAndItsLocationMovesTheOrigin) {
  const auto conf = RegistriesConf::parse(kConf, "test.conf");
  const std::string digest = "sha256:" + std::string(64, 'a');
  // By tag: mirror-by-digest-only keeps it at the origin, which `location` moved.
  EXPECT_EQ(where(conf, "oci://registry.example.com/team/models/llama:v1"),
            (std::vector<std::string>{"oci://models.example.com/team/llama:v1 https origin"}));
  EXPECT_EQ(where(conf, "oci://registry.example.com/team/models/llama@" + digest),
            (std::vector<std::string>{
                "oci://cache.cluster.local:5000/models/llama@" + digest + " http mirror",
                "oci://models.example.com/team/llama@" + digest + " https origin"}));
  // A prefix matches whole path segments only.
  EXPECT_EQ(where(conf, "oci://registry.example.com/team/modelsx:v1").front(),
            "oci://cache.cluster.local:5000/team/modelsx:v1 http mirror");
}

TEST(RegistriesConf, WildcardsReplaceTheHostAndPullFromMirrorChoosesTagsOrDigests) {
  const auto conf = RegistriesConf::parse(kConf, "test.conf");
  EXPECT_EQ(where(conf, "oci://reg.corp.example:8443/a/b:v2"),
            (std::vector<std::string>{"oci://cache.cluster.local:5000/a/b:v2 http mirror",
                                      "oci://reg.corp.example:8443/a/b:v2 https origin"}));
  const std::string digest = "sha256:" + std::string(64, 'b');
  EXPECT_EQ(where(conf, "oci://reg.corp.example/a/b@" + digest),
            (std::vector<std::string>{"oci://reg.corp.example/a/b@" + digest + " https origin"}));
  // The bare domain is not a subdomain of itself.
  EXPECT_EQ(where(conf, "oci://corp.example/a:v1").size(), 1u);
}

TEST(RegistriesConf, ANameNoEntryMatchesIsPulledFromItsRegistryAlone) {
  const auto conf = RegistriesConf::parse(kConf, "test.conf");
  EXPECT_EQ(where(conf, "oci://127.0.0.1:5000/x/y:z", true),
            (std::vector<std::string>{"oci://127.0.0.1:5000/x/y:z http origin"}));
  EXPECT_EQ(where(RegistriesConf::parse("", "empty.conf"), "oci://h.example/x:1").size(), 1u);
}

TEST(RegistriesConf, ABlockedRegistryIsRefusedWithItsReason) {
  const auto conf = RegistriesConf::parse(kConf, "test.conf");
  const Error e = catch_error([&] { (void)where(conf, "oci://blocked.example.com/x:1"); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_TRUE(Contains(e.what(), "blocked by the registries configuration"));
}

TEST(RegistriesConf, DamagedFilesAreRefusedNamingTheFileAndTheEntry) {
  struct Case {
    const char* text;
    const char* says;
  };
  for (const Case& c : std::vector<Case>{
           {"[[registry", "not TOML"},
           {"registry = 3", "not an array of tables"},
           {"[[registry]]\ninsecure = true", "neither `prefix` nor `location`"},
           {"[[registry]]\nlocation = 5", "`location` is not a string"},
           {"[[registry]]\nlocation = \"a.example\"\nblocked = \"yes\"", "not true or false"},
           {"[[registry]]\nlocation = \"a b\"", "is not HOST[:PORT][/PATH]"},
           {"[[registry]]\nprefix = \"*.x.example\"\nlocation = \"y.example\"",
            "a wildcard prefix takes none"},
           {"[[registry]]\nlocation = \"a.example\"\n[[registry.mirror]]\nlocation = \"m/UP\"",
            "mirror #1: location"},
           {"[[registry]]\nlocation = \"a.example\"\n[[registry.mirror]]\nlocation = "
            "\"m.example\"\npull-from-mirror = \"sometimes\"",
            "not all, digest-only or tag-only"},
       }) {
    const Error e = catch_error([&] { (void)RegistriesConf::parse(c.text, "bad.conf"); });
    EXPECT_EQ(e.kind(), ErrorKind::kUsage) << c.text;
    EXPECT_TRUE(Contains(e.what(), "bad.conf")) << c.text;
    EXPECT_TRUE(Contains(e.what(), c.says)) << c.text;
  }
  const Error big =
      catch_error([] { (void)RegistriesConf::parse(std::string(2 << 20, '#'), "big.conf"); });
  EXPECT_TRUE(Contains(big.what(), "larger than 1 MiB"));
}

TEST(RegistriesConf, AFileNamedOnTheCommandLineMustExistAndLaterDropInsReplaceEarlierEntries) {
  TempDir dir;
  const Error e = catch_error([&] { (void)RegistriesConf::load((dir / "absent.conf").string()); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_TRUE(Contains(e.what(), "absent.conf"));
  fs::write_file(dir / "r.conf", kConf);
  const auto conf = RegistriesConf::load((dir / "r.conf").string());
  EXPECT_EQ(conf.entries().size(), 4u);
  EXPECT_EQ(conf.files(), (std::vector<std::string>{(dir / "r.conf").string()}));
}

}  // namespace
}  // namespace gpusnap::testing
