// What agents that serve each other chunks read from one another and from their flags
// (store/peer_request.h, store/peers.h): the chunk request's target, which peer owns a digest,
// the peers list and its token file.
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/fs.h"
#include "gpusnap/error.h"
#include "store/blob_store.h"
#include "store/digest.h"
#include "store/peer_request.h"
#include "store/peers.h"
#include "testing/unit.h"

namespace gpusnap::testing {
namespace {

using store::PeerRequest;

const std::string kDigest = "sha256:" + std::string(64, 'a');

TEST(PeerRequest, ATargetReadsBackAsWritten) {
  const PeerRequest r{kDigest, 4096, "registry.example:5000/team/snaps"};
  EXPECT_EQ(r.target(),
            "/v1/chunks/" + kDigest + "?size=4096&repository=registry.example:5000/team/snaps");
  const PeerRequest back = PeerRequest::parse(r.target());
  EXPECT_EQ(back.digest, r.digest);
  EXPECT_EQ(back.size, r.size);
  EXPECT_EQ(back.repository, r.repository);
  // Up to the largest blob a snapshot holds, a sealed chunk's few bytes included.
  const std::string largest = std::to_string(store::kMaxPeerBlobBytes);
  EXPECT_EQ(
      PeerRequest::parse("/v1/chunks/" + kDigest + "?size=" + largest + "&repository=h/r").size,
      store::kMaxPeerBlobBytes);
  EXPECT_EQ(catch_error([&] {
              (void)PeerRequest::parse("/v1/chunks/" + kDigest +
                                       "?size=" + std::to_string(store::kMaxPeerBlobBytes + 1) +
                                       "&repository=h/r");
            }).kind(),
            ErrorKind::kUsage);
  // Its parameters in any order.
  EXPECT_EQ(PeerRequest::parse("/v1/chunks/" + kDigest + "?repository=h/r&size=1").repository,
            "h/r");
}

TEST(PeerRequest, WhatAPeerCannotAskIsRefusedSayingWhy) {
  const std::string path = "/v1/chunks/" + kDigest;
  struct Case {
    std::string target;
    const char* says;
  };
  for (const Case& c : std::vector<Case>{
           {"/v1/chunk/" + kDigest + "?size=1&repository=h/r", "not a path under /v1/chunks/"},
           {"/v1/chunks/sha256:ABC?size=1&repository=h/r", "the digest is not sha256:"},
           {"/v1/chunks/" + kDigest + "/x?size=1&repository=h/r", "the digest is not sha256:"},
           {path, "no size and repository"},
           {path + "?size=1", "size and repository are both required"},
           {path + "?size=1&size=2&repository=h/r", "size given twice"},
           {path + "?size=-1&repository=h/r", "not a decimal number"},
           {path + "?size=99999999999999999999&repository=h/r", "not a decimal number"},
           {path + "?size=0&repository=h/r", "0 or larger than any chunk"},
           {path + "?size=1073741824&repository=h/r", "0 or larger than any chunk"},
           {path + "?size=1&repository=h/UPPER", "not HOST[:PORT]/REPO"},
           {path + "?size=1&repository=h", "not HOST[:PORT]/REPO"},
           {path + "?size=1&repository=h/r/../x", "not HOST[:PORT]/REPO"},
           {path + "?size=1&repository=h/r&repository=h/r", "repository given twice"},
           {path + "?size=1&repository=h/r&x=1", "unknown parameter"},
           {path + "?size=1&repository", "a parameter without a value"},
           {path + "?size=1&repository=h/" + std::string(2000, 'r'), "longer than 1 KiB"},
       }) {
    const Error e = catch_error([&] { (void)PeerRequest::parse(c.target); });
    EXPECT_EQ(e.kind(), ErrorKind::kUsage) << c.target;
    EXPECT_TRUE(Contains(e.what(), c.says)) << c.target << ": " << e.what();
  }
}

TEST(RankPeers, EveryNodeRanksThePeersAlikeAndALeavingPeerMovesOnlyItsChunks) {
  const std::vector<std::string> four = {"10.0.0.1:7070", "10.0.0.2:7070", "10.0.0.3:7070",
                                         "10.0.0.4:7070"};
  const std::vector<std::string> reversed(four.rbegin(), four.rend());
  std::map<std::string, int> owned;
  int moved = 0;
  for (int i = 0; i < 4000; ++i) {
    const std::string digest = store::sha256_digest(std::to_string(i));
    const auto rank = store::rank_peers(four, digest);
    ASSERT_EQ(rank.size(), 4u);
    // The list's order does not matter: nodes may be handed it in any.
    EXPECT_EQ(store::rank_peers(reversed, digest), rank);
    ++owned[rank[0]];
    // Without the fourth peer, a chunk it did not own keeps its owner; one it owned goes to the
    // next in its rank.
    const std::vector<std::string> three(four.begin(), four.end() - 1);
    const std::string owner = store::rank_peers(three, digest)[0];
    if (rank[0] == four[3]) {
      EXPECT_EQ(owner, rank[1]);
      ++moved;
    } else {
      EXPECT_EQ(owner, rank[0]);
    }
  }
  // Each owns about a quarter.
  for (const auto& p : four) {
    EXPECT_GT(owned[p], 800) << p;
    EXPECT_LT(owned[p], 1200) << p;
  }
  EXPECT_EQ(moved, owned[four[3]]);
}

TEST(PeerList, ReadFromAFlagOrAFileWithCommentsEachPeerOnce) {
  EXPECT_EQ(store::parse_peer_list(
                "10.0.0.1:7070, node-b.example:7070,[fd00::1]:7070,10.0.0.1:7070", "--peers"),
            (std::vector<std::string>{"10.0.0.1:7070", "node-b.example:7070", "[fd00::1]:7070"}));
  EXPECT_EQ(store::parse_peer_list("# the agents\n10.0.0.1:7070\n\n10.0.0.2:7070  # rack 2\n",
                                   "peers.txt"),
            (std::vector<std::string>{"10.0.0.1:7070", "10.0.0.2:7070"}));
  for (const char* bad :
       {"10.0.0.1", "10.0.0.1:0", "10.0.0.1:70700", "a b:1", ":7070", "[fd00::1:7070", "h:x"}) {
    const Error e = catch_error([&] { (void)store::parse_peer_list(bad, "--peers"); });
    EXPECT_EQ(e.kind(), ErrorKind::kUsage) << bad;
    EXPECT_TRUE(Contains(e.what(), "is not ADDR:PORT")) << bad << ": " << e.what();
  }
}

// An agent names itself from its --listen as its peers' lists name it: the same string for an
// IPv4 address and for an IPv6 one, which lists write in brackets.
TEST(PeerList, AnAgentsOwnNameIsWrittenAsPeersListsWriteIt) {
  EXPECT_EQ(store::peer_name("10.0.0.5", 7070), "10.0.0.5:7070");
  EXPECT_EQ(store::peer_name("fd00::5", 7070), "[fd00::5]:7070");
  EXPECT_EQ(store::peer_name("node-a.example", 7070), "node-a.example:7070");
  for (const auto& [address, port] : std::vector<std::pair<std::string, int>>{
           {"10.0.0.5", 7070}, {"fd00::5", 7070}, {"node-a.example", 1}}) {
    const std::string name = store::peer_name(address, port);
    EXPECT_EQ(store::parse_peer_list(name, "--peers"), std::vector<std::string>{name}) << name;
  }
}

TEST(PeerList, PeersNeedAPrivateTokenAndATokenNeedsPeers) {
  TempDir dir;
  EXPECT_EQ(store::read_peers("", "", "", ""), nullptr);  // off by default
  const auto text = [](auto f) { return std::string(catch_error(f).what()); };
  EXPECT_TRUE(Contains(text([] { (void)store::read_peers("10.0.0.1:7070", "", "", ""); }),
                       "--peer-token-file"));
  const std::string token = (dir / "token").string();
  EXPECT_TRUE(Contains(text([&] { (void)store::read_peers("", "", "", token); }),
                       "--peer-token-file needs --peers"));
  fs::write_file(dir / "token", "short\n");
  ::chmod(token.c_str(), 0600);
  EXPECT_TRUE(Contains(text([&] { (void)store::read_peers("10.0.0.1:7070", "", "", token); }),
                       "shorter than 16 characters"));
  fs::write_file(dir / "token", "0123456789abcdef0123\n");
  ::chmod(token.c_str(), 0644);
  EXPECT_TRUE(Contains(text([&] { (void)store::read_peers("10.0.0.1:7070", "", "", token); }),
                       "readable by everyone"));
  ::chmod(token.c_str(), 0600);
  fs::write_file(dir / "peers", "10.0.0.2:7070\n10.0.0.1:7070\n");
  const auto peers = store::read_peers("10.0.0.1:7070", (dir / "peers").string(), "", token);
  ASSERT_NE(peers, nullptr);
  EXPECT_EQ(peers->list(), (std::vector<std::string>{"10.0.0.1:7070", "10.0.0.2:7070"}));
  EXPECT_EQ(peers->token(), "0123456789abcdef0123");
  EXPECT_EQ(peers->members(), peers->list());
  // A name stands for every address it resolves to, as a headless Service's does.
  const auto named = store::read_peers("", "", "localhost:7070", token);
  ASSERT_NE(named, nullptr);
  const auto members = named->members();
  EXPECT_NE(std::find(members.begin(), members.end(), "127.0.0.1:7070"), members.end())
      << ::testing::PrintToString(members);
}

TEST(PeerChunks, AnOwnerFetchesOnlyForItsRepositoryAndAsItsRegistriesConfAllows) {
  TempDir dir;
  fs::write_file(dir / "registries.conf",
                 "[[registry]]\nlocation = \"blocked.example\"\nblocked = true\n");
  store::PeerServing serving;
  serving.cache = dir / "cache";
  serving.registry.registries_conf = (dir / "registries.conf").string();
  serving.repositories = {"blocked.example/team/snaps"};
  store::PeerChunks chunks(serving);
  // Refused before any connection: neither host exists.
  const Error other = catch_error([&] {
    (void)chunks.get({kDigest, 10, "registry.example/team/snaps"});
  });
  EXPECT_EQ(other.kind(), ErrorKind::kUsage);
  EXPECT_TRUE(
      Contains(other.what(), "this agent fetches no chunks of registry.example/team/snaps"));
  const Error blocked = catch_error([&] {
    (void)chunks.get({kDigest, 10, "blocked.example/team/snaps"});
  });
  EXPECT_EQ(blocked.kind(), ErrorKind::kUsage);
  EXPECT_TRUE(Contains(blocked.what(), "blocked by the registries configuration"));
  EXPECT_EQ(chunks.bytes_fetched(), 0u);
  // What the node cache holds is served from it, checked against its digest.
  const std::string data = "a chunk's bytes";
  const std::string digest = store::sha256_digest(data);
  store::BlobStore(serving.cache).put(digest, data);
  EXPECT_EQ(chunks.get({digest, data.size(), "blocked.example/team/snaps"}), data);
  EXPECT_EQ(chunks.bytes_served(), data.size());
}

}  // namespace
}  // namespace gpusnap::testing
