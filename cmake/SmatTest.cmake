# Test helpers. Labels: unit, mpi (run under mpirun), gpu (skip loudly without a GPU), e2e.
# A GoogleTest that calls GTEST_SKIP is reported by CTest as skipped, not passed.

set(SMAT_TEST_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;NCCL_NVLS_ENABLE=0")

# Open MPI keeps a job's session files under <base>/ompi.<host>.<uid>, one
# directory for every job of the user. When ctest -j starts several mpiruns at
# once they race to create it, and one can fail at startup ("A call to mkdir
# was unable to create the desired directory ... File exists", open-mpi/ompi
# issue 8510). Each test gets a base of its own: short, since PMIx puts its
# sockets below it, and one per build tree.
string(MD5 SMAT_BUILD_HASH "${CMAKE_BINARY_DIR}")
string(SUBSTRING "${SMAT_BUILD_HASH}" 0 8 SMAT_BUILD_HASH)
set(SMAT_MPI_SESSIONS "/tmp/smat-tests-${SMAT_BUILD_HASH}")

# smat_test_env(<var> [NAME=value ...]): in <var>, the environment of one more
# test: SMAT_TEST_ENV, an Open MPI session base of its own, and the settings
# given.
function(smat_test_env var)
  get_property(count GLOBAL PROPERTY SMAT_TEST_COUNT)
  if(NOT count)
    set(count 0)
  endif()
  math(EXPR count "${count} + 1")
  set_property(GLOBAL PROPERTY SMAT_TEST_COUNT ${count})
  set(env ${SMAT_TEST_ENV} "OMPI_MCA_orte_tmpdir_base=${SMAT_MPI_SESSIONS}/${count}" ${ARGN})
  set(${var} "${env}" PARENT_SCOPE)
endfunction()

# smat_add_gtest(NAME name SOURCES ... LIBS ... [LABELS ...] [TIMEOUT s] [ARGS ...])
# Adds a test executable and registers it as one CTest test (run with ARGS,
# e.g. a --gtest_filter that leaves out cases registered as another test).
function(smat_add_gtest)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS;ARGS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
  target_compile_options(${T_NAME} PRIVATE ${SMAT_WARNINGS})
  add_test(NAME ${T_NAME} COMMAND ${T_NAME} ${T_ARGS})
  smat_test_env(env)
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "${env}" SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
endfunction()

# smat_add_mpi_test(NAME name TARGET exe NP n [ARGS ...] [LABELS ...] [TIMEOUT s])
# Runs an existing executable under mpirun with n ranks (label mpi added).
function(smat_add_mpi_test)
  cmake_parse_arguments(T "" "NAME;TARGET;NP;TIMEOUT" "ARGS;LABELS" ${ARGN})
  add_test(NAME ${T_NAME}
    COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${T_NP} --oversubscribe
            --bind-to none $<TARGET_FILE:${T_TARGET}> ${T_ARGS})
  smat_test_env(env)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS "mpi;${T_LABELS}" TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "${env}" SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
endfunction()
