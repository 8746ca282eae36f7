// Whether an artifact may run on this host (check_host_compatible), and the --publish syntax
// (PortPublish::parse).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "gpusnap/restore.h"
#include "testing/unit.h"

namespace gpusnap {
namespace {

using namespace gpusnap::testing;  // testing/unit.h

// As HostFacts::probe reports them: cpu_flags sorted.
HostFacts facts() {
  HostFacts h;
  h.hostname = "source";
  h.kernel = "6.8.0";
  h.arch = "x86_64";
  h.cpu_model = "Intel(R) Xeon(R) Platinum 8480+";
  h.cpu_flags = {"aes", "avx",        "avx2", "avx512f", "constant_tsc",
                 "fpu", "hypervisor", "sse",  "sse2",    "sse4_2"};
  h.criu_version = "4.2";
  h.page_size = 4096;
  return h;
}

Manifest manifest_from(const HostFacts& host) {
  Manifest m;
  m.host = host;
  return m;
}

std::vector<std::string> without(std::vector<std::string> flags,
                                 const std::vector<std::string>& drop) {
  std::erase_if(flags, [&](const std::string& f) {
    return std::find(drop.begin(), drop.end(), f) != drop.end();
  });
  return flags;
}

Error incompatible(const Manifest& m, const HostFacts& here) {
  Error e = catch_error([&] { check_host_compatible(m, here); });
  EXPECT_EQ(e.kind(), ErrorKind::kIncompatible);
  return e;
}

TEST(CompatTest, IdenticalHostsAreCompatible) {
  EXPECT_NO_THROW(check_host_compatible(manifest_from(facts()), facts()));
}

TEST(CompatTest, HostnameKernelAndCpuModelMayDiffer) {
  HostFacts here = facts();
  here.hostname = "target";
  here.kernel = "6.11.0";
  here.cpu_model = "Intel(R) Xeon(R) Platinum 8580";
  here.cpu_flags.push_back("avx512_fp16");  // more than the source had
  std::sort(here.cpu_flags.begin(), here.cpu_flags.end());
  EXPECT_NO_THROW(check_host_compatible(manifest_from(facts()), here));
}

TEST(CompatTest, RefusesOtherArchitecture) {
  HostFacts here = facts();
  here.arch = "aarch64";
  Error e = incompatible(manifest_from(facts()), here);
  EXPECT_STREQ(e.what(), "artifact was taken on x86_64, this host is aarch64");
  EXPECT_EQ(e.hint(), "restore it on a x86_64 host");
}

TEST(CompatTest, RefusesOtherPageSize) {
  HostFacts here = facts();
  here.page_size = 65536;
  Error e = incompatible(manifest_from(facts()), here);
  EXPECT_STREQ(e.what(), "artifact was taken with 4096-byte pages, this host uses 65536");
}

TEST(CompatTest, RefusesCpuLackingAnInstructionSet) {
  HostFacts here = facts();
  here.cpu_flags = without(here.cpu_flags, {"avx512f"});
  Error e = incompatible(manifest_from(facts()), here);
  EXPECT_STREQ(e.what(), "this host's CPU lacks instruction sets the source used: avx512f");
  EXPECT_TRUE(Contains(e.hint(), "Intel(R) Xeon(R) Platinum 8480+"));
}

TEST(CompatTest, ListsEveryMissingInstructionSetInOrder) {
  HostFacts here = facts();
  here.cpu_flags = without(here.cpu_flags, {"aes", "avx2", "avx512f", "sse4_2"});
  Error e = incompatible(manifest_from(facts()), here);
  EXPECT_STREQ(e.what(),
               "this host's CPU lacks instruction sets the source used: aes, avx2, avx512f, "
               "sse4_2");
}

TEST(CompatTest, LongListOfMissingInstructionSetsIsCut) {
  HostFacts source = facts();
  source.cpu_flags = {"avx",     "avx2",     "avx512bw", "avx512cd", "avx512dq",
                      "avx512f", "avx512vl", "bmi1",     "bmi2",     "fma"};
  HostFacts here = facts();
  here.cpu_flags = {"fpu", "sse", "sse2"};
  Error e = incompatible(manifest_from(source), here);
  EXPECT_STREQ(e.what(),
               "this host's CPU lacks instruction sets the source used: avx, avx2, avx512bw, "
               "avx512cd, avx512dq, avx512f, avx512vl, bmi1, ...");
}

TEST(CompatTest, IgnoresMissingFlagsThatAreNotInstructionSets) {
  HostFacts here = facts();
  here.cpu_flags = without(here.cpu_flags, {"hypervisor", "constant_tsc", "fpu"});
  EXPECT_NO_THROW(check_host_compatible(manifest_from(facts()), here));
}

TEST(CompatTest, Sse3IsAnInstructionSetUnderItsCpuinfoNamePni) {
  HostFacts source = facts();
  source.cpu_flags.push_back("pni");
  std::sort(source.cpu_flags.begin(), source.cpu_flags.end());
  Error e = incompatible(manifest_from(source), facts());
  EXPECT_STREQ(e.what(), "this host's CPU lacks instruction sets the source used: pni");
  EXPECT_NO_THROW(check_host_compatible(manifest_from(source), source));
}

TEST(CompatTest, ToleratesUnsortedFlagsOnThisHost) {
  // probe() sorts cpu_flags; a HostFacts from elsewhere may not be sorted.
  HostFacts here = facts();
  std::reverse(here.cpu_flags.begin(), here.cpu_flags.end());
  ASSERT_FALSE(std::is_sorted(here.cpu_flags.begin(), here.cpu_flags.end()));
  EXPECT_NO_THROW(check_host_compatible(manifest_from(facts()), here));

  here.cpu_flags = without(here.cpu_flags, {"avx2"});
  Error e = incompatible(manifest_from(facts()), here);
  EXPECT_STREQ(e.what(), "this host's CPU lacks instruction sets the source used: avx2");
}

TEST(CompatTest, ProbeReportsSortedCpuFlags) {
  HostFacts h = HostFacts::probe("4.2");
  EXPECT_TRUE(std::is_sorted(h.cpu_flags.begin(), h.cpu_flags.end()));
}

TEST(CompatTest, RefusesOlderCriu) {
  HostFacts here = facts();
  here.criu_version = "4.1";
  Error e = incompatible(manifest_from(facts()), here);
  EXPECT_STREQ(e.what(), "artifact was written by CRIU 4.2, this host has CRIU 4.1");
  EXPECT_TRUE(Contains(e.hint(), "install CRIU 4.2 or newer"));
  EXPECT_TRUE(Contains(e.hint(), "scripts/install-criu"));

  HostFacts source = facts();
  source.criu_version = "4.10";
  here.criu_version = "4.9";
  EXPECT_TRUE(Contains(incompatible(manifest_from(source), here).what(), "CRIU 4.10"));
}

TEST(CompatTest, AcceptsSameOrNewerCriu) {
  for (const char* version : {"4.2", "4.2.1", "4.3", "4.10", "5.0"}) {
    HostFacts here = facts();
    here.criu_version = version;
    EXPECT_NO_THROW(check_host_compatible(manifest_from(facts()), here)) << version;
  }
}

TEST(CompatTest, ArchitectureIsReportedFirst) {
  HostFacts here = facts();
  here.arch = "aarch64";
  here.page_size = 65536;
  here.cpu_flags = {"asimd", "fp"};
  here.criu_version = "4.0";
  EXPECT_TRUE(Contains(incompatible(manifest_from(facts()), here).what(), "aarch64"));
}

TEST(PortPublishTest, PortOnly) {
  PortPublish p = PortPublish::parse("8080");
  EXPECT_EQ(p.host_address, "127.0.0.1");
  EXPECT_EQ(p.host_port, 0);
  EXPECT_EQ(p.port, 8080);
}

TEST(PortPublishTest, HostPortAndPort) {
  PortPublish p = PortPublish::parse("9000:8080");
  EXPECT_EQ(p.host_address, "127.0.0.1");
  EXPECT_EQ(p.host_port, 9000);
  EXPECT_EQ(p.port, 8080);
  EXPECT_EQ(PortPublish::parse("0:8080").host_port, 0) << "0: any free port";
  EXPECT_EQ(PortPublish::parse("65535:1").host_port, 65535);
}

TEST(PortPublishTest, AddressHostPortAndPort) {
  PortPublish p = PortPublish::parse("0.0.0.0:9000:8080");
  EXPECT_EQ(p.host_address, "0.0.0.0");
  EXPECT_EQ(p.host_port, 9000);
  EXPECT_EQ(p.port, 8080);
}

TEST(PortPublishTest, RefusesBadSpecs) {
  struct Case {
    const char* text;
    const char* message;
  };
  const Case cases[] = {
      {"", "bad port '' in --publish "},
      {"x", "bad port 'x' in --publish x"},
      {"70000", "bad port '70000' in --publish 70000"},
      {"65536", "bad port '65536' in --publish 65536"},
      {"-1", "bad port '-1' in --publish -1"},
      {"80x", "bad port '80x' in --publish 80x"},
      {"x:8080", "bad port 'x' in --publish x:8080"},
      {"9000:", "bad port '' in --publish 9000:"},
      {":8080", "bad port '' in --publish :8080"},
      {"1:2:3:4", "bad --publish 1:2:3:4"},
      {"0", "--publish needs the copy's port, not 0"},
      {"9000:0", "--publish needs the copy's port, not 0"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    Error e = catch_error([&] { PortPublish::parse(c.text); });
    EXPECT_EQ(e.kind(), ErrorKind::kUsage);
    EXPECT_STREQ(e.what(), c.message);
  }
  EXPECT_EQ(catch_error([] { PortPublish::parse("x"); }).hint(),
            "use --publish PORT, HOSTPORT:PORT or ADDR:HOSTPORT:PORT");
}

}  // namespace
}  // namespace gpusnap
